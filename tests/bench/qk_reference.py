#!/usr/bin/python3
"""What a user would write instead of foreshock's QK kernel, timed per head-sample.

The same quantity as tests/bench/qk_bench.cc: singular values of the
first-order QK increment dS1 = (dQ K0^T + Q0 dK^T) / sqrt(d) of one head
(fp32 inputs, increments ~1% of the values), by
  - numpy dense: dS1 formed n x n in float64, np.linalg.svd(compute_uv=False);
  - numpy QR-factored: thin QR of A = [dQ | Q0] and B = [K0 | dK] (float64),
    singular values of the 2d x 2d core R_a R_b^T;
  - numpy full head-sample: the QR-factored spectrum with the top left
    singular vector plus causal attention entropy and max logit (float32
    logits), like BM_FullHeadSample;
  - torch dense: torch.linalg.svdvals of dS1 (float64), if torch imports.
Single-threaded (OPENBLAS_NUM_THREADS=1, torch.set_num_threads(1)), like the
C++ benchmark. Run with Debian's interpreter, which sees python3-numpy and
python3-torch:

    OPENBLAS_NUM_THREADS=1 /usr/bin/python3 tests/bench/qk_reference.py

Prints the median of --repetitions timings (each the mean of a loop of about
--min-time seconds), in ms per head-sample.
"""
import argparse
import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import statistics  # noqa: E402
import time  # noqa: E402

import numpy as np  # noqa: E402

try:
    import torch  # noqa: E402

    torch.set_num_threads(1)
except Exception:  # noqa: BLE001 - any import failure means "not available"
    torch = None


def head_pair(n, d, seed=1234):
    rng = np.random.default_rng(seed)
    q_prev = rng.standard_normal((n, d), dtype=np.float32)
    k_prev = rng.standard_normal((n, d), dtype=np.float32)
    q = q_prev + np.float32(0.01) * rng.standard_normal((n, d), dtype=np.float32)
    k = k_prev + np.float32(0.01) * rng.standard_normal((n, d), dtype=np.float32)
    return q_prev, k_prev, q, k


def dense_numpy(q_prev, k_prev, q, k):
    q_prev, k_prev, q, k = (x.astype(np.float64) for x in (q_prev, k_prev, q, k))
    d = q.shape[1]
    ds1 = ((q - q_prev) @ k_prev.T + q_prev @ (k - k_prev).T) / np.sqrt(d)
    return np.linalg.svd(ds1, compute_uv=False)


def qr_numpy(q_prev, k_prev, q, k, top_vector=False):
    q_prev, k_prev, q, k = (x.astype(np.float64) for x in (q_prev, k_prev, q, k))
    d = q.shape[1]
    qa, ra = np.linalg.qr(np.hstack([q - q_prev, q_prev]))
    _, rb = np.linalg.qr(np.hstack([k_prev, k - k_prev]))
    core = ra @ rb.T / np.sqrt(d)
    if not top_vector:
        return np.linalg.svd(core, compute_uv=False), None
    u, sigma, _ = np.linalg.svd(core)
    return sigma, qa @ u[:, 0]


def attention_numpy(q, k):
    n, d = q.shape
    logits = (q @ k.T) / np.float32(np.sqrt(d))  # float32, as the detector
    logits[np.triu_indices(n, 1)] = -np.inf  # causal
    row_max = logits.max(axis=1, keepdims=True)
    shifted = logits - row_max
    e = np.exp(shifted)
    z = e.sum(axis=1)
    weighted = (e * np.where(np.isfinite(shifted), shifted, 0)).sum(axis=1)
    entropy = np.log(z) - weighted / z
    return entropy.mean(), row_max.max()


def full_head_numpy(q_prev, k_prev, q, k):
    sigma, u = qr_numpy(q_prev, k_prev, q, k, top_vector=True)
    return sigma, u, attention_numpy(q, k)


def dense_torch(q_prev, k_prev, q, k):
    q_prev, k_prev, q, k = (torch.from_numpy(x).double() for x in (q_prev, k_prev, q, k))
    d = q.shape[1]
    ds1 = ((q - q_prev) @ k_prev.T + q_prev @ (k - k_prev).T) / d**0.5
    return torch.linalg.svdvals(ds1)


def time_ms(function, args, min_time, repetitions):
    samples = []
    for _ in range(repetitions):
        iterations, start = 0, time.perf_counter()
        while True:
            function(*args)
            iterations += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time:
                break
        samples.append(1e3 * elapsed / iterations)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--min-time", type=float, default=0.5)
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args()
    print(f"numpy {np.__version__}, torch {torch.__version__ if torch else 'not importable'}, "
          f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS')}")
    # Agreement check (not timed): the QR-factored values equal the dense ones.
    pair = head_pair(128, 32)
    dense, factored = dense_numpy(*pair), qr_numpy(*pair)[0]
    assert np.allclose(dense[: factored.size], factored, rtol=0, atol=1e-9 * dense[0])
    rows = []
    for n, d in ((256, 64), (512, 64)):
        pair = head_pair(n, d)
        rows.append((f"numpy dense svd, n={n} d={d}", time_ms(dense_numpy, pair, args.min_time, args.repetitions)))
        rows.append((f"numpy QR-factored, n={n} d={d}", time_ms(qr_numpy, pair, args.min_time, args.repetitions)))
        if torch is not None:
            rows.append((f"torch dense svdvals, n={n} d={d}", time_ms(dense_torch, pair, args.min_time, args.repetitions)))
    pair = head_pair(256, 64)
    rows.append(("numpy full head-sample (QR spectrum + top vector + causal attention), n=256 d=64",
                 time_ms(full_head_numpy, pair, args.min_time, args.repetitions)))
    for name, ms in rows:
        print(f"{name:90s} {ms:9.3f} ms")


if __name__ == "__main__":
    main()
