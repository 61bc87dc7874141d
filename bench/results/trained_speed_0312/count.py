import sys, time, json, collections
from pathlib import Path
sys.path.insert(0, str(Path.cwd()))
import adbatch.decoding.beam_search as BS
import adbatch.decoding as D
import adbatch.decoding.engine as E
count = collections.Counter()
orig_init = E.DecodeEngine.__init__
def init(self, *a, **k):
    count["engines"] += 1; return orig_init(self, *a, **k)
E.DecodeEngine.__init__ = init
orig = BS.search_targets
def st(*a, **k):
    t0 = time.perf_counter(); r = orig(*a, **k); count["calls"] += 1; count["s"] += time.perf_counter() - t0
    count.update({f"st_{k}": v for k, v in r.stats.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    return r
BS.search_targets = st; D.search_targets = st
import bench.train_eval as TE
try:
    TE.main(sys.argv[1:])
finally:
    print("COUNT", json.dumps({k: round(v, 2) for k, v in count.items()}), flush=True)
