"""Two-Mac generation with the library. It takes the same flags as `ds4tp run`, and it is one
rank: run it twice, the leader and the worker, each with the same --model.

On two Macs (the leader's Thunderbolt address is 10.99.0.1):

    mac1$ python examples/pair_generate.py --model PATH --prompt "Hello" \
              --role leader --listen 10.99.0.1 9911
    mac2$ python examples/pair_generate.py --model PATH --role worker --coordinator 10.99.0.1 9911

On one machine, both ranks on 127.0.0.1, with the demo's small synthetic model (its text is
noise; `--model demo` builds it once into ~/.cache/mlx_ds4tp):

    $ python examples/pair_generate.py --model demo --role worker --coordinator 127.0.0.1 9911 &
      python examples/pair_generate.py --model demo --prompt "Hello" --max-tokens 16 \
              --role leader --listen 127.0.0.1 9911; wait

Without --role/--listen/--coordinator the two find each other on --interface (the Thunderbolt
Bridge's members on a Mac), as `ds4tp run`'s ranks do.

Both ranks join the pair, each loads its half of the model, then the leader
tokenizes, samples and streams the text while the worker runs the same
forward passes in lockstep (its gates pair up with the leader's).
"""

import argparse
import sys

import mlx_ds4tp as tp
from mlx_ds4tp.cli.run import add_args as add_run_args, check_args as check_run_args
from mlx_ds4tp.gate_ops import init_pair
from mlx_ds4tp.link.identity import model_identity
from mlx_ds4tp.lockstep.generate import encode_prompt, pair_generate
from mlx_ds4tp.lockstep.protocol.sessions import LeaderSessions, serve_worker
from mlx_ds4tp.model_split import load_split


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_run_args(parser)
    args = parser.parse_args()
    # The same checks as `ds4tp run`: how this rank joins the pair (link), the model's
    # directory, and what the leader generates (the sampling flags as mlx-lm's options).
    link, model_dir, run = check_run_args(args)
    # The pair: the leader listens, the worker dials. The model's identity (its shape and
    # its weights' fingerprint) rides in the hello, so two different models stop here
    # instead of after loading. Without --listen/--coordinator the two ranks find each other
    # on --interface, as `ds4tp run`'s do (the rank with --prompt leads).
    identity = model_identity(model_dir)
    if link.discovery is not None:
        group = init_pair(link, identity)
    else:
        group = tp.init(
            role=link.address.role,
            listen=link.address.listen,
            coordinator=link.address.coordinator,
            transport=link.transport,
            rdma_device=link.rdma_device,
            gid_index=link.gid_index,
            secret=link.secret,
            identity=identity,
        )
    leader = group.rank() == 0
    with group:
        # Each rank reads only its half of the weights from the safetensors files.
        model, tokenizer = load_split(model_dir, group)

        if not leader:
            table = serve_worker(group, model)  # the leader's commands, until it says stop
            print(f"worker: served {table.ended} prompt(s)", file=sys.stderr)
            return 0

        # The leader drives both ranks' sessions: each command it sends, it runs too.
        sessions = LeaderSessions(group, model)
        try:
            prompt_tokens = encode_prompt(tokenizer, run.prompt, chat=run.chat)
            detokenizer = tokenizer.detokenizer
            detokenizer.reset()

            def stream(token: int) -> None:
                detokenizer.add_token(token)
                print(detokenizer.last_segment, end="", flush=True)

            # The same sampling flags as `ds4tp run`, drawn as mlx-lm draws them (on both
            # ranks: each samples for itself, so each step is queued while the last runs).
            eos = set(tokenizer.eos_token_ids or [])
            stats = pair_generate(sessions, prompt_tokens, run.max_tokens, run.sampling, on_token=stream,
                                  eos=eos, debug_hash=run.debug_hash)
            detokenizer.finalize()
            print(detokenizer.last_segment, flush=True)
        finally:
            sessions.stop()  # releases the worker
        print(stats.line(group), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
