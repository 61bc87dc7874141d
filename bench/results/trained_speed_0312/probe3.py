"""Throwaway device probe (issue 16): trained vs pretrained vs random on the full trie, real vs random prompts,
one call vs per-batch calls, fresh process. Prints one line per row."""
import json, sys, time
from collections import Counter
from pathlib import Path
import torch
sys.path.insert(0, str(Path.cwd()))
from adbatch.models import load_causal_lm
from adbatch.index import load_index
from adbatch.prompts import encode_targeting_prompts
from adbatch.decoding import TargetSearchConfig, search_targets
import adbatch.decoding.engine as E
from bench.decode import build_model, random_prompts

trained_dir, gguf, bundle = sys.argv[1:4]
index = load_index(f"{bundle}/index_full_text")
qs = sorted(json.load(open(f"{bundle}/qrels_test_full.json")))[:512]
trained, tok = load_causal_lm(trained_dir, device="cuda")
pre, _ = load_causal_lm(gguf, device="cuda")
rnd = build_model("default", torch.device("cuda"), False)
prompts = encode_targeting_prompts(tok, qs)
rprompts = random_prompts(512, 40, 100, 40000, 0)
print("prompt len mean", sum(map(len, prompts)) / len(prompts), "max", max(map(len, prompts)))
trie_gpu = index.trie.to("cuda")
for name, m in (("trained", trained), ("pretrained", pre), ("random", rnd)):
    e = E.engine_for(m)
    print(name, "dtype", e.dtype, "fused groups", len(e._fused), "store_fused", e.store_fused, "act", e.act,
          "lin types", sorted(Counter(type(x).__name__ for x in m.modules() if hasattr(x, "weight")).items()),
          "vocab", e.vocab, "tie", m.config.tie_word_embeddings, flush=True)

def run(tag, m, ps, batch=64, per_call=False, profile=False, trie=index.trie):
    cfg = TargetSearchConfig(num_beams=10, top_k=10, verify="off", batch_size=batch, profile=profile)
    agg = Counter()
    with torch.inference_mode():
        search_targets(m, ps[:batch], trie, cfg)
        torch.cuda.synchronize(); t0 = time.perf_counter()
        chunks = [ps[s:s + batch] for s in range(0, len(ps), batch)] if per_call else [ps]
        for c in chunks:
            st = search_targets(m, c, trie, cfg).stats
            agg.update({k: v for k, v in st.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
        torch.cuda.synchronize(); wall = time.perf_counter() - t0
    e = E.engine_for(m)
    row = {"tag": tag, "q/s": round(len(ps) / wall, 1), "wall_s": round(wall, 2),
           "ms/step": round(1e3 * wall / max(agg["steps"], 1), 2), "graphs": len(e._graphs),
           "capture_s": round(e.capture_seconds, 2),
           **{k: round(v, 1) for k, v in agg.items() if k in ("steps", "compactions", "decode_rows", "rows_computed", "width_max", "width_sum") or k.startswith("ms_")}}
    print(json.dumps(row), flush=True)

run("trained real one-call", trained, prompts)
run("trained real per-call", trained, prompts, per_call=True)
run("trained real per-call trie-gpu", trained, prompts, per_call=True, trie=trie_gpu)
run("trained random-prompts one-call", trained, rprompts)
run("trained real one-call profile", trained, prompts, profile=True)
run("pretrained real one-call", pre, prompts)
run("random real one-call", rnd, prompts)
run("random random-prompts one-call", rnd, rprompts)
run("random real one-call profile", rnd, prompts, profile=True)
run("trained real one-call @256", trained, prompts, batch=256)
from torch.profiler import profile, ProfilerActivity
cfg = TargetSearchConfig(num_beams=10, top_k=10, verify="off", batch_size=64)
with torch.inference_mode(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
    search_targets(trained, prompts[:128], index.trie, cfg); torch.cuda.synchronize()
ev = p.key_averages()
print(ev.table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60))
print(ev.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
