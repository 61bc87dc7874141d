"""Throwaway device probe (issue 16): the trained model's targeting speed by query batch, fresh process,
real chat-framed prompts (train-split query strings, distinct), 10 beams, top 10, off; profiled phases."""
import json, sys, time
from collections import Counter
from pathlib import Path
import pyarrow.parquet as pq
import torch
sys.path.insert(0, str(Path.cwd()))
from adbatch.models import load_causal_lm
from adbatch.index import load_index
from adbatch.prompts import encode_targeting_prompts
from adbatch.decoding import TargetSearchConfig, search_targets

trained_dir, bundle = sys.argv[1:3]
index = load_index(f"{bundle}/index_full_text")
qs = sorted(set(pq.read_table(f"{bundle}/train_full.parquet").column("query").to_pylist()))[:4096]
m, tok = load_causal_lm(trained_dir, device="cuda")
prompts = encode_targeting_prompts(tok, qs)
trie = index.trie.to("cuda")
rows = []
for batch in (64, 256, 1024, 2048):
    n = min(len(prompts), max(4 * batch, 1024))
    for verify in ("off", "auto"):
        for prof in (False, True):
            if prof and verify == "auto":
                continue
            cfg = TargetSearchConfig(num_beams=10, top_k=10, verify=verify, batch_size=batch, profile=prof)
            walls, st = [], None
            with torch.inference_mode():
                search_targets(m, prompts[:batch], trie, cfg)  # warm-up: this bucket's graphs
                for rep in range(1 if prof else 3):
                    torch.cuda.synchronize(); t0 = time.perf_counter()
                    st = search_targets(m, prompts[:n], trie, cfg).stats
                    torch.cuda.synchronize(); walls.append(time.perf_counter() - t0)
            w = sorted(walls)[len(walls) // 2]
            row = {"batch": batch, "verify": verify, "profile": prof, "queries": n, "q/s": round(n / w, 1),
                   "walls": [round(x, 3) for x in walls], "ms/step": round(1e3 * w / max(st["steps"], 1), 2),
                   **{k: (round(v, 1) if isinstance(v, float) else v) for k, v in st.items()
                      if k in ("steps", "compactions", "verify_passes", "beams_verified", "width_max") or k.startswith("ms_")}}
            print(json.dumps(row), flush=True)
            rows.append(row)
Path(sys.argv[3]).write_text(json.dumps(rows, indent=1))
