"""A model of your own, split across the pair with the drop-in gate.

One run of this script is one rank: start it twice, the leader and the worker. On one machine,
both on 127.0.0.1 (each prints its own result line):

    $ python examples/gate_layer.py --role leader --listen 127.0.0.1 9911 &
      python examples/gate_layer.py --role worker --coordinator 127.0.0.1 9911; wait

On two Macs, the leader's Thunderbolt address instead (add `--transport rdma` to require RDMA):

    mac1$ python examples/gate_layer.py --role leader --listen 10.99.0.1 9911
    mac2$ python examples/gate_layer.py --role worker --coordinator 10.99.0.1 9911

The model is a small stack of residual MLP blocks. Split Megatron style, each rank keeps half
of every block's hidden features: its half of `up` (column parallel: no communication) and the
matching half of `down` (row parallel: each rank's output is a partial sum). One AllSumGate per
block adds the two partials, so both ranks continue with the same total. Both ranks build the
same weights from the same seed, run the split model, and compare with the unsplit one.
"""

import argparse
import hashlib
import sys

import mlx.core as mx
import mlx.nn as nn

import mlx_ds4tp as tp
from mlx_ds4tp.model_split import AllSumGate

DIM, HIDDEN, BLOCKS = 64, 256, 3


class Block(nn.Module):
    """x + down(gelu(up(norm(x)))): the unsplit block."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return x + self.down(nn.gelu(self.up(self.norm(x))))


class SplitBlock(nn.Module):
    """The same block holding this rank's half of the hidden features, gated once."""

    def __init__(self, block: Block, group):
        super().__init__()
        rank, size = group.rank(), group.size()
        part = block.up.weight.shape[0] // size
        keep = slice(rank * part, (rank + 1) * part)
        self.norm = block.norm  # replicated: every rank normalises the whole x
        self.up = nn.Linear(DIM, part, bias=False)
        self.up.weight = block.up.weight[keep]  # rows: this rank's hidden features
        self.down = nn.Linear(part, DIM, bias=False)
        self.down.weight = block.down.weight[:, keep]  # columns: the same features
        self.gate = AllSumGate(group)  # the one collective of the block

    def __call__(self, x: mx.array) -> mx.array:
        return x + self.gate(self.down(nn.gelu(self.up(self.norm(x)))))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=("leader", "worker"), required=True)
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--listen", nargs=2, metavar=("HOST", "PORT"), help="leader: address to listen on")
    where.add_argument("--coordinator", nargs=2, metavar=("HOST", "PORT"), help="worker: the leader's address")
    parser.add_argument("--transport", choices=("auto", "tcp", "rdma"), default="auto")
    parser.add_argument("--rdma-device", default=None, help="verbs device, or 'ucsim' (emulated)")
    args = parser.parse_args()
    host, port = args.listen or args.coordinator
    if not port.isdigit():
        parser.error(f"PORT {port!r} must be a number, e.g. 9911")
    address = {"listen" if args.listen else "coordinator": (host, int(port))}

    with tp.init(role=args.role, transport=args.transport, rdma_device=args.rdma_device, **address) as group:
        mx.random.seed(0)  # the same weights and inputs on both ranks
        blocks = [Block(DIM, HIDDEN) for _ in range(BLOCKS)]
        x = mx.random.normal((4, DIM))

        reference = x
        for block in blocks:
            reference = block(reference)
        split = x
        for block in [SplitBlock(b, group) for b in blocks]:
            split = block(split)
        mx.eval(reference, split)

        error = mx.abs(split - reference).max().item()
        digest = hashlib.sha256(memoryview(split)).hexdigest()[:16]
        print(f"rank {group.rank()} ({group.transport}): {BLOCKS} blocks, {BLOCKS} gates; "
              f"max |split - unsplit| = {error:.2e}; output sha256 {digest}")
        print(f"rank {group.rank()}: matches the unsplit model: {error < 1e-4}")
    return 0 if error < 1e-4 else 1


if __name__ == "__main__":
    sys.exit(main())
