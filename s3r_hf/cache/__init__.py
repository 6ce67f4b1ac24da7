"""Paged KV storage, the `S3RCache`, and sparse index views into it."""

from s3r_hf.cache.index_view import SparseIndexViews
from s3r_hf.cache.kv_offload import KVOffloader, OffloadedRequest
from s3r_hf.cache.page_allocator import KVCapacityError, PageAllocator
from s3r_hf.cache.s3r_cache import PagedKVLayer, S3RCache

__all__ = [
    "KVCapacityError",
    "KVOffloader",
    "OffloadedRequest",
    "PageAllocator",
    "PagedKVLayer",
    "S3RCache",
    "SparseIndexViews",
]
