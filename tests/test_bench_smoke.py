"""Every benchmark in bench/ answers ``--help`` and runs its ``--smoke`` path on the CPU (tiny random-init
models, synthetic inputs), so a script cannot rot between GPU runs. Scripts whose smoke path another test
already runs end to end with finer checks are named in ELSEWHERE instead of being run twice."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"

#: script -> (arguments after --smoke, a check of (stdout, tmp folder)): what the smoke run must leave behind
SMOKE = {
    "compress_8b.py": (["--out", "{tmp}"], lambda out, tmp: "mask + adaptive INT4 + pack" in (tmp / "compress_8b.md").read_text()),
    "creatives_guards.py": (["--work", "{tmp}", "--out-json", "{tmp}/g.jsonl"],
                            lambda out, tmp: [json.loads(x)["variant"] for x in (tmp / "g.jsonl").read_text().splitlines()]
                            == ["dense:3:6", "compressed:3:6"]),
    "decode.py": (["--out", "{tmp}"], lambda out, tmp: (tmp / "decode_gpu_default.md").is_file()
                  and (tmp / "decode_gpu_8b.md").is_file()),
    # the generate driver's peak RSS per request count (dense channel over a 200-ad index), Ray and local
    "driver_memory.py": (["--work", "{tmp}/work", "--out", "{tmp}"], lambda out, tmp: "| ray | 800 |" in out
                         and "| local | 200 |" in out and all(
        r["answered"] == r["requests"] and r["peak_rss_mib"] > 0
        for r in json.loads((tmp / "driver_memory.json").read_text())["rows"])),
    "fp8_layers.py": (["--out", "{tmp}/f.md"], lambda out, tmp: all(
        set(json.loads(x)["rel_err"]) == {"bf16", "int4_2:4", "fp8"} and json.loads(x)["rel_err"]["fp8"] < 0.06
        for x in (tmp / "f.jsonl").read_text().splitlines())),
    # the library vs the CLI, then the answer cache (answer_cache=0 vs the default) on Zipf-repeated requests
    "generate_gpu.py": (["--requests", "16", "--ads", "100", "--work", "{tmp}"], lambda out, tmp: "top-10 ad ids: IDENTICAL"
                        in out and "ad ids per request, answer_cache=0 vs cached:" in out and "| 65,536 | 16 |" in out),
    "host_cost.py": ([], lambda out, tmp: "| 2:4 INT4 copy |" in out and "| dense bf16 |" in out),
    "ids.py": (["--work", "{tmp}"], lambda out, tmp: all(f"| {d} |" in out for d in ("codes", "text", "rq 2x8"))),
    "index.py": ([], lambda out, tmp: "| 2,000 | 1 |" in out),
    "kernel_accuracy.py": ([], lambda out, tmp: out.count("| 64 |") == 6),
    "kernel_sass.py": ([], lambda out, tmp: "| tc | 2:4 | 16 |" in out),
    "kernels.py": (["--out", "{tmp}"], lambda out, tmp: (tmp / "kernels.json").is_file()),
    "large_rows.py": (["--out", "{tmp}/lr.md"], lambda out, tmp: "| 4 | 32 |" in (tmp / "lr.md").read_text()),
    # the generate phase only: its train and kill phases add minutes of Ray Train on 2 cores
    "scale_out.py": (["--phases", "generate", "--work", "{tmp}/work"], lambda out, tmp: "creatives: 1 vs N actors" in out
                     and (tmp / "scale_out.json").is_file()),
    "train_eval.py": (["--smoke-out", "{tmp}"], lambda out, tmp: {"dense", "dense untuned", "generative b10",
                                                                   "hybrid b10", "hybrid beam_floor b10"}
                      <= set(json.loads((tmp / "channels" / "results.json").read_text())["rows"])),
    # the refresh end to end on a tiny model over a 200-ad scale set (~2 min); every output checked
    "night_scale.py": (["--work", "{tmp}/work", "--out", "{tmp}"], lambda out, tmp: "| generate_targets | ran |" in out
                       and json.loads((tmp / "night_scale.json").read_text())["all_outputs_ok"]),
    "scale_set.py": (["--out", "{tmp}"], lambda out, tmp: json.loads((tmp / "scale_set.json").read_text())["counts"]
                     == {"ads": 200, "advertisers": 20, "target_requests": 1000, "creative_requests": 50}),
    "stable_ids.py": (["--out", "{tmp}"], lambda out, tmp: all(
        r["incremental_same_sequence"] == 1.0 for r in json.loads((tmp / "stable_ids.json").read_text()))),
    "step_profile.py": (["--out", "{tmp}/sp.md"], lambda out, tmp: "step ms (eager)" in (tmp / "sp.md").read_text()),
}
#: script -> the test that runs its --smoke path (with assertions on its rows)
ELSEWHERE = {
    "creatives_tune.py": "tests/test_creative_tune_bench.py",
    "query_gen_speed.py": "tests/test_query_gen_speed_bench.py",
    "targeting_speed.py": "tests/test_targeting_speed_bench.py",
    "train_throughput.py": "tests/test_training_packing.py",
}

ENV = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TRITON_INTERPRET="1", PYTHONPATH=str(REPO))


def test_every_script_is_smoke_tested_and_lists_smoke_in_its_help():
    scripts = sorted(p.name for p in BENCH.glob("*.py"))
    assert set(scripts) == set(SMOKE) | set(ELSEWHERE)
    for script, test in ELSEWHERE.items():
        assert "--smoke" in (REPO / test).read_text(), (script, test)
    # one interpreter for every --help (the imports are shared): each prints a marker, then its help
    loop = ("import runpy, sys\n"
            "for f in sys.argv[1:]:\n"
            "    print('@@', f, flush=True)\n"
            "    sys.argv = [f, '--help']\n"
            "    try:\n"
            "        runpy.run_path(f, run_name='__main__')\n"
            "    except SystemExit as e:\n"
            "        assert e.code in (0, None), (f, e.code)\n")
    done = subprocess.run([sys.executable, "-c", loop, *[str(BENCH / s) for s in scripts]], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    helps = {Path(h.split(None, 1)[0]).name: h for h in done.stdout.split("@@ ")[1:]}
    assert sorted(helps) == scripts
    assert [s for s, h in helps.items() if "--smoke" not in h] == []


@pytest.mark.parametrize("script", sorted(SMOKE))
def test_smoke(script, tmp_path):
    args, check = SMOKE[script]
    cmd = [sys.executable, str(BENCH / script), "--smoke", *[a.format(tmp=tmp_path) for a in args]]
    done = subprocess.run(cmd, cwd=REPO, env=dict(ENV, OUT=str(tmp_path)), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    assert check(done.stdout, tmp_path), done.stdout[-3000:]


def test_ids_agreement_places_each_query_in_its_ads_clusters(tmp_path):
    """bench/ids.py agreement: a query whose vector is its relevant ad's own lands on that ad's whole path
    (prefix@d = 1 at every depth); one placed at another topic's ad does not (issue 55: ids from a tuned encoder)."""
    import json

    import numpy as np
    from safetensors.numpy import load_file

    from adbatch.index.build import load_index
    from test_generate_support import tiny_index_dir

    sys.path.insert(0, str(BENCH))
    import ids as bench_ids

    index_dir = tiny_index_dir(tmp_path)
    index = load_index(index_dir)
    emb = load_file(str(index_dir / "embeddings.safetensors"))["embeddings"].astype(np.float32)
    codes = index.ad_codes.column("code").to_pylist()
    far = [max(range(len(codes)), key=lambda r: -float(emb[r] @ emb[i])) for i in range(6)]  # least similar ad
    queries = [f"q{i}" for i in range(6)] + [f"far{i}" for i in range(6)]
    vecs = np.concatenate([emb[:6], emb[far]])
    np.savez(tmp_path / "q.npz", queries=np.asarray(queries), emb=vecs)
    qrels = {q: {str(index.ad_ids[i % 6]): 3.0} for i, q in enumerate(queries)}
    (tmp_path / "qrels.json").write_text(json.dumps(qrels))
    args = bench_ids.argparse.Namespace(index=str(index_dir), query_emb=str(tmp_path / "q.npz"),
                                        qrels=str(tmp_path / "qrels.json"))
    own = bench_ids.cmd_agreement(args)
    assert own["queries"] == 12 and own["prefix@1"] < 1.0
    qrels = {q: v for q, v in qrels.items() if q.startswith("q")}
    (tmp_path / "qrels.json").write_text(json.dumps(qrels))
    assert bench_ids.cmd_agreement(args)["prefix@1"] == bench_ids.cmd_agreement(args)["prefix@2"] == 1.0
