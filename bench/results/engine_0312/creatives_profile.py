"""Where a creatives call's time goes (default shape, random bf16, 256 prompts x 40 tokens, greedy 16)."""
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from bench.decode import IdTokenizer, build_model, no_eos, random_prompts  # noqa: E402

import adbatch.decoding as ours  # noqa: E402
from adbatch.decoding.engine import engine_for  # noqa: E402

dev = torch.device("cuda")
model = build_model("default", dev, False)
never = model.config.vocab_size
tok = IdTokenizer(never, pad_token_id=model.config.pad_token_id)
prompts = random_prompts(256, 40, 1000, 48000, seed=2)
T = 16
bare = ours.CreativeConfig(max_new_tokens=T, stop_strings=[], batch_size=256, no_repeat_ngram_size=0,
                           prompt_ngram_block=0)
prod = ours.CreativeConfig(max_new_tokens=T, stop_strings=[], batch_size=256)


def timed(fn, n=5):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(1e3 * (time.perf_counter() - t0))
    return round(statistics.median(ts), 2), [round(t, 1) for t in ts]


with no_eos(model), torch.no_grad():
    for cfg in (bare, prod):
        ours.generate_creatives(model, tok, prompts, cfg)
        ours.generate_creatives(model, tok, prompts, cfg)
    eng = engine_for(model)
    print("bare call ms", timed(lambda: ours.generate_creatives(model, tok, prompts, bare)))
    print("guards call ms", timed(lambda: ours.generate_creatives(model, tok, prompts, prod)))
    print("prefill ms", timed(lambda: eng.prefill(prompts, 1, T)))
    toks = torch.randint(1000, 40000, (256,), device=dev)

    def steps():
        for t in range(T):
            eng.step(toks, t, 256)
    eng.prefill(prompts, 1, T)
    print("16 steps ms", timed(steps))
    ids = torch.tensor(prompts, device=dev)
    mask = torch.ones_like(ids)
    hf = lambda: model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=T, min_new_tokens=T,  # noqa: E731
                                pad_token_id=model.config.pad_token_id)
    hf()
    print("hf ms", timed(hf, 3))
    from torch.profiler import ProfilerActivity, profile
    for name, cfg in (("bare", bare), ("guards", prod)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            ours.generate_creatives(model, tok, prompts, cfg)
            torch.cuda.synchronize()
        ev = prof.key_averages()
        print(f"=== {name}: top by self CUDA")
        print(ev.table(sort_by="self_cuda_time_total", row_limit=15, max_name_column_width=60))
        print(f"=== {name}: top by CPU total")
        print(ev.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60))
