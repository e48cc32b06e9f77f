"""Golden indices of torch.utils.data.DistributedSampler over a sweep of dataset sizes, world sizes,
ranks, shuffling, drop_last, seeds and epochs: the shard each rank reads."""
import itertools
import json

import torch
from torch.utils.data import DistributedSampler


def generate(out):
    cases = []
    for n, replicas, shuffle, drop_last, seed, epoch in itertools.product(
            [1, 2, 3, 7, 10, 64, 101], [1, 2, 3, 4, 8], [False, True], [False, True], [0, 42],
            [0, 3]):
        if not shuffle and (seed, epoch) != (0, 0):
            continue  # without shuffling the seed and epoch change nothing
        for rank in range(replicas):
            s = DistributedSampler(list(range(n)), num_replicas=replicas, rank=rank,
                                   shuffle=shuffle, seed=seed, drop_last=drop_last)
            s.set_epoch(epoch)
            cases.append({"n": n, "replicas": replicas, "rank": rank, "shuffle": shuffle,
                          "drop_last": drop_last, "seed": seed, "epoch": epoch,
                          "indices": list(iter(s)), "len": len(s)})
    (out / "distributed_sampler.json").write_text(json.dumps({"cases": cases}))
