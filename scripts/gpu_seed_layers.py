#!/usr/bin/env python3
"""Where a prefill pass of the seed-shape model spends its time on the GPU (issue 26): mlx-lm's
own modules of one layer of each kind on the model that make_seed_model.py wrote, timed on a
4096-token pass. Not CI.

    python3 gpu_seed_layers.py MODEL_DIR
"""
import json
import sys
import time

import mlx.core as mx

_gather_qmm = mx.gather_qmm


def gather_qmm(*a, global_scale=None, **k):
    return _gather_qmm(*a, **k)


mx.gather_qmm = gather_qmm
from mlx_lm import load  # noqa: E402


def timed(f, *args, repeat=3):
    mx.eval(f(*args))
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(f(*args))
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    model, _ = load(sys.argv[1])
    layers = model.language_model.model.layers
    out = {}
    for t in (1, 4096):
        x = mx.random.normal((1, t, 2048)).astype(mx.float16)
        moe = layers[0].mlp
        out[f"moe_{t}"] = timed(moe, x)
        sw = moe.switch_mlp
        inds = mx.argpartition(-moe.gate(x), kth=7, axis=-1)[..., :8]
        out[f"switch_glu_{t}"] = timed(sw, x, inds)
        q = layers[3].self_attn
        out[f"attention_projections_{t}"] = timed(lambda x: q.q_proj(x) + 0, x)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
