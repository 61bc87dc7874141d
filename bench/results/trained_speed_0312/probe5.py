"""Throwaway device probe (issue 16): HF generate + trie prefix_allowed_tokens_fn vs ours, same trained model,
same test queries, full trie, 10 beams, top 10; top-10 agreement."""
import json, sys, time
from pathlib import Path
import torch
sys.path.insert(0, str(Path.cwd()))
from adbatch.models import load_causal_lm
from adbatch.index import load_index
from adbatch.prompts import encode_targeting_prompts
from adbatch.decoding import TargetSearchConfig, search_targets
from bench.decode import hf_search, rows_of

trained_dir, bundle, nq = sys.argv[1], sys.argv[2], int(sys.argv[3])
index = load_index(f"{bundle}/index_full_text")
qs = sorted(json.load(open(f"{bundle}/qrels_test_full.json")))[:nq]
m, tok = load_causal_lm(trained_dir, device="cuda")
prompts = encode_targeting_prompts(tok, qs)
trie = index.trie
eos = index.eos_token_id if index.eos_token_id is not None else tok.eos_token_id
pad = tok.pad_token_id if tok.pad_token_id is not None else eos
with torch.inference_mode():
    hf_search(m, prompts[:2], trie, 10, 10, eos, pad)  # warm-up
    torch.cuda.synchronize(); t0 = time.perf_counter()
    seqs, _ = hf_search(m, prompts, trie, 10, 10, eos, pad)
    torch.cuda.synchronize(); hf_s = time.perf_counter() - t0
    hf_rows = rows_of(trie, seqs)
    cfg = TargetSearchConfig(num_beams=10, top_k=10, verify="off", batch_size=nq)
    search_targets(m, prompts, trie, cfg)
    walls = []
    for _ in range(3):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        res = search_targets(m, prompts, trie, cfg)
        torch.cuda.synchronize(); walls.append(time.perf_counter() - t0)
ours = res.rows.tolist()
agree = sum(len(set(a) & set(r for r in b if r >= 0)) for a, b in zip(hf_rows, ours)) / max(1, sum(len(a) for a in hf_rows))
w = sorted(walls)[1]
print(json.dumps({"queries": nq, "hf_q/s": round(nq / hf_s, 2), "ours_off_q/s": round(nq / w, 1),
                  "ratio": round(hf_s / w, 1), "ours_walls": [round(x, 3) for x in walls],
                  "top10_overlap_with_hf": round(agree, 3)}))
