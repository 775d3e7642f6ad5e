"""Two-Mac generation: run this on both machines (same flags as `ds4tp run`).

    mac1$ python examples/pair_generate.py --model PATH --prompt "Hello" \
              --role leader --listen 10.99.0.1 9911
    mac2$ python examples/pair_generate.py --model PATH --role worker --coordinator 10.99.0.1 9911

What happens, in the package's own terms:

    g = mlx_ds4tp.init(role=..., listen=/coordinator=..., transport="auto")   # the pair
    model, tokenizer = mlx_ds4tp.model_split.load_split(PATH, g)            # each rank: its half
    Leader(g, model, tokenizer).generate(...)  /  Worker(g, model).serve()  # lockstep decode
"""

import sys

from mlx_ds4tp.cli import main

if __name__ == "__main__":
    sys.exit(main(["run", *sys.argv[1:]]))
