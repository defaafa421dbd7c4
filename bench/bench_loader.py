"""Loader throughput: rank batches of TOKENS tokens at MAX_SEQ_LEN, planned for 1 rank
(rank-slice) and for 8 ranks (every rank plans the whole step), copied to the GPU.

    python bench/bench_loader.py "data/proxy/proxy_train_*.bin" [tokens] [max_seq_len] [batches]
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train_gpt as T  # noqa: E402


def main():
    pattern = sys.argv[1]
    tokens = int(sys.argv[2]) if len(sys.argv) > 2 else 49152
    max_seq_len = int(sys.argv[3]) if len(sys.argv) > 3 else 2048
    batches = int(sys.argv[4]) if len(sys.argv) > 4 else 2000
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    for world in (1, 8):
        passes = []
        loader = T.TrainLoader(pattern, rank=0, world_size=world, device=device, log=passes.append)
        loader.next_batch(tokens, max_seq_len)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(batches):
            inputs, targets, cu = loader.next_batch(tokens, max_seq_len)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        print(f"world {world} (plans {world} ranks): {batches} batches of {tokens} tokens in {seconds:.2f} s = "
              f"{batches / seconds:.0f} batches/s, {batches * tokens / seconds / 1e6:.1f}M tokens/s per rank "
              f"({len(passes)} wraps over the files)")


if __name__ == "__main__":
    main()
