"""`s3r-hf bench` end to end on a CPU with a tiny random shape: it runs every method, writes JSON and a plot,
and its exact greedy S3R run reproduces greedy engine AR (the check the GPU runs report as `=AR`)."""

from __future__ import annotations

import json

import torch

from s3r_hf.cli import main


def test_bench_runs_and_greedy_s3r_matches_ar(tmp_path, capsys):
    json_path, plot_path = tmp_path / "bench.json", tmp_path / "bench.png"
    main([
        "bench", "--model", "qwen3-tiny", "--batch", "3", "--seq", "40,64", "--max-new-tokens", "12",
        "--budget", "0.1,0.5", "--refresh-interval", "1,2", "--min-budget", "4", "--draft-len", "3",
        "--dtype", "float32", "--device", "cpu", "--stages", "--json", str(json_path), "--plot", str(plot_path),
    ])
    result = json.loads(json_path.read_text())
    assert [(p["batch"], p["seq"]) for p in result["points"]] == [(3, 40), (3, 64)]
    for point in result["points"]:
        assert set(point["s3r"]) == {"0.1 r1", "0.1 r2", "0.5 r1", "0.5 r2"}
        for run in point["s3r"].values():
            assert run["greedy_matches_ar"] is True
            assert set(run["stage_ms_per_step"]) == {"draft", "verify", "accept", "refresh", "commit"}
            assert set(run["stage_floor_ms"]) == {"draft", "verify", "accept", "refresh"}
            assert 1.0 <= run["tau"] <= 4.0
        assert point["hf_generate"]["tokens_per_s"] > 0
    assert plot_path.stat().st_size > 0
    assert "engine AR" in capsys.readouterr().out


def test_greedy_agreement_reports_where_rows_part():
    from s3r_hf.bench import greedy_agreement

    ar = torch.tensor([[9, 9, 1, 2, 3, 4], [9, 9, 5, 6, 7, 8], [9, 9, 1, 1, 1, 1]])
    assert greedy_agreement(ar.clone(), ar, prompt_len=2) == {
        "greedy_matches_ar": True, "greedy_rows_differing": 0, "greedy_first_divergence": None,
    }
    s3r = ar.clone()
    s3r[0, 4:] = 0  # row 0 parts at generated token 2, row 2 at token 3
    s3r[2, 5] = 0
    assert greedy_agreement(s3r, ar, prompt_len=2) == {
        "greedy_matches_ar": False, "greedy_rows_differing": 2, "greedy_first_divergence": 2,
    }


def test_bench_runs_a_queue_of_requests_at_most_batch_at_a_time(tmp_path):
    json_path = tmp_path / "bench.json"
    main([
        "bench", "--model", "qwen3-tiny", "--batch", "2", "--requests", "5", "--seq", "40", "--max-new-tokens", "10",
        "--budget", "0.5", "--min-budget", "4", "--draft-len", "3", "--dtype", "float32", "--device", "cpu",
        "--skip-generate", "--draft-weights", "model,int8", "--json", str(json_path),
    ])
    point = json.loads(json_path.read_text())["points"][0]
    assert (point["batch"], point["requests"]) == (2, 5)
    assert set(point["s3r"]) == {"0.5", "0.5 int8"}
    for run in (point["engine_ar"], point["s3r"]["0.5"], point["s3r"]["0.5 int8"]):
        assert 1.0 <= run["mean_rows_per_step"] <= 2.0
    # All five rows of greedy S3R equal those of greedy engine AR, with the model's and with 8-bit draft weights.
    assert point["s3r"]["0.5"]["greedy_matches_ar"] is True
    assert point["s3r"]["0.5 int8"]["greedy_matches_ar"] is True


def test_stage_floors_count_the_bytes_each_stage_must_move():
    from s3r_hf.bench import build_model, stage_floors_ms
    from s3r_hf.config import S3RConfig

    model, _ = build_model("qwen3-tiny", torch.float32, "cpu")  # 2 layers, 2 KV heads of 16, vocab 512
    weights = sum(p.numel() for p in model.parameters()) * 4
    kv_per_token = 2 * 2 * 2 * 16 * 4  # K and V, layers, KV heads, head dim, fp32
    config = S3RConfig(draft_len=3, budget_ratio=0.1, min_budget=8)  # budget 10 of a 100-token context
    views = 4 * 2 * 2 * 10 * 4  # int32 positions: batch, layers, KV heads, budget
    floors = stage_floors_ms(model, batch=4, context=100, config=config, bandwidth=1e3)  # 1 KB/s: ms = bytes
    assert floors == {
        "draft": 3 * (weights + 4 * 10 * kv_per_token + views),
        "verify": weights + 4 * 100 * kv_per_token,
        "accept": 2 * 4 * 4 * 512 * 4,
        "refresh": 4 * 2 * 2 * 100 * 4 + views,
    }
    # 8-bit draft weights: the decoder layers' linears at one byte a weight in the draft passes, plus a float32 scale
    # per output feature or per group of 64 weights; the rest as it is
    linears = [m.weight for layer in model.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    weights8 = sum(w.numel() for w in linears)
    for draft_weights, scales in (("int8", sum(w.shape[0] for w in linears)), ("int8-g64", weights8 // 64)):
        int8 = S3RConfig(draft_len=3, budget_ratio=0.1, min_budget=8, draft_weights=draft_weights)
        floors8 = stage_floors_ms(model, batch=4, context=100, config=int8, bandwidth=1e3)
        assert floors8["draft"] == floors["draft"] - 3 * (weights8 * 3 - 4 * scales)
        assert {k: v for k, v in floors8.items() if k != "draft"} == {k: v for k, v in floors.items() if k != "draft"}
