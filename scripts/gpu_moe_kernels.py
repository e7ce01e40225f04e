#!/usr/bin/env python3
"""Prefill of one mixture-of-experts layer at the seed's shape (256 experts of 512, hidden 2048,
8 per token, 4-bit) on the GPU, two ways: gather_qmm on the codes (what mlx-lm and Strata run)
against expanding the codes to float16 first and gather_mm. Sorted pairs in both. Not CI.

    python3 gpu_moe_kernels.py
"""
import json
import time

import mlx.core as mx


def timed(f, repeat=5):
    mx.eval(f())
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(f())
        times.append(time.perf_counter() - start)
    return min(times)


def main():
    experts, width, hidden, k = 256, 512, 2048, 8
    w = mx.random.normal((experts, width, hidden)).astype(mx.float16) * 0.02
    wq, scales, biases = mx.quantize(w, 64, 4)
    out = {}
    for tokens in (512, 4096):
        x = mx.random.normal((tokens * k, 1, hidden)).astype(mx.float16)
        idx = mx.sort(mx.random.randint(0, experts, (tokens * k,)).astype(mx.uint32))
        mx.eval(x, idx, wq, scales, biases)
        out[f"gather_qmm_{tokens}"] = timed(lambda: mx.gather_qmm(
            x, wq, scales, biases, rhs_indices=idx, transpose=True, group_size=64, bits=4,
            sorted_indices=True))

        def expanded():
            dense = mx.dequantize(wq, scales, biases, 64, 4).swapaxes(-1, -2)
            return mx.gather_mm(x, dense, rhs_indices=idx, sorted_indices=True)
        out[f"dequantize_gather_mm_{tokens}"] = timed(expanded)
        dense = mx.dequantize(wq, scales, biases, 64, 4)
        mx.eval(dense)
        out[f"dequantize_only_{tokens}"] = timed(lambda: mx.dequantize(wq, scales, biases, 64, 4))
        dt = dense.swapaxes(-1, -2)
        out[f"gather_mm_only_{tokens}"] = timed(lambda: mx.gather_mm(
            x, dt, rhs_indices=idx, sorted_indices=True))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
