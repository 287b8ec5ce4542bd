"""A user-format JSONL file to score: facts stated once inside held-out documentation text (issue #4).

`rkv eval --tasks` takes any JSONL of {"id", "context", "question", "answers"}. No such file exists offline,
and questions about the documentation itself get no answer from SmolLM2-135M even with the full cache
(BENCHMARKS.md: 0/16). This writes one where the full cache does answer part of the time: each row's
context is held-out corpus text (documents no codec trains on) with one everyday fact inserted between
two sentences at a random depth (an office room, a password, a platform, where keys are kept, a meeting
city, a budget), and the question asks for it in plain words. Unlike the synthetic suite there is no
"magic number" wording, the prompt is not cut to an exact length, and the answer is a word, a place,
a two-word password or a number.

    python benchmarks/user_facts.py --context-len 2048 --n 24 --seed 0 --out facts_2k.jsonl
    rkv eval --backbone smollm2-135m --tasks facts_2k.jsonl --context-len 2048 --methods full,residualkv-r10 ...

Each prompt (chat template included, as the harness encodes it) is at most --context-len tokens and at
least 32 fewer, so `rkv eval --context-len` never truncates it. Deterministic in (seed, context length).
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from residualkv.evaluation.samples import Sample, encode_prompt, write_jsonl  # noqa: E402
from residualkv.evaluation.synthetic import Haystacks, insert_at_depths  # noqa: E402

NAMES = ["Maria", "Tomas", "Aiko", "Priya", "Oskar", "Leila", "Dmitri", "Nadia", "Kofi", "Elena", "Rafael", "Ingrid"]
CITIES = ["Lisbon", "Oslo", "Nairobi", "Osaka", "Lima", "Krakow", "Dublin", "Hanoi", "Quito", "Tallinn"]
PLACES = ["blue toolbox", "kitchen drawer", "top shelf", "glovebox", "garden shed", "red suitcase", "piano bench"]
COLORS = ["green", "orange", "purple", "silver", "yellow", "crimson"]
ANIMALS = ["falcon", "otter", "badger", "heron", "lynx", "walrus", "gecko"]
PROJECTS = ["Apollo", "Juniper", "Nimbus", "Cobalt", "Sparrow", "Granite", "Meridian"]
SLACK = 32  # a prompt may fall this many tokens short of the context length


def fact(rng: random.Random) -> tuple[str, str, str]:
    """(statement, question, answer) of one everyday fact."""
    name, city, project = rng.choice(NAMES), rng.choice(CITIES), rng.choice(PROJECTS)
    room, platform, budget = str(rng.randint(100, 999)), str(rng.randint(2, 19)), str(rng.randint(1000, 9999))
    place, password = rng.choice(PLACES), f"{rng.choice(COLORS)}-{rng.choice(ANIMALS)}"
    return rng.choice([
        (f"{name}'s office is in room {room}.", f"Which room is {name}'s office in?", room),
        (f"The password for the {project} server is {password}.", f"What is the password for the {project} server?",
         password),
        (f"The train to {city} leaves from platform {platform}.", f"Which platform does the train to {city} leave from?",
         platform),
        (f"{name} keeps the spare keys in the {place}.", f"Where does {name} keep the spare keys?", place),
        (f"The {project} team meets every week in {city}.", f"In which city does the {project} team meet every week?",
         city),
        (f"The budget of the {project} project is {budget} dollars.", f"What is the budget of the {project} project?",
         budget),
    ])


def make_samples(tokenizer, context_len: int, n: int, seed: int) -> list[Sample]:
    haystacks = Haystacks(tokenizer)
    rng = random.Random(f"user-facts:{seed}:{context_len}")
    samples = []
    for i in range(n):
        statement, question, answer = fact(rng)
        depth, start = rng.uniform(0.1, 0.9), rng.random()

        def render(filler: int) -> tuple[Sample, int]:
            context = insert_at_depths(haystacks.text("essay", filler, start), [statement], [depth])
            s = Sample(id=f"facts-{context_len}-{seed}-{i}", task="jsonl", context=context,
                       question=f"According to the text above: {question} Answer in a few words.", answers=[answer],
                       meta={"fact": statement})
            return s, len(encode_prompt(tokenizer, s))

        filler = context_len - 96
        for _ in range(8):  # decoding and re-encoding the filler moves its length a little: settle it
            sample, length = render(filler)
            if context_len - SLACK <= length <= context_len:
                break
            filler += context_len - SLACK // 2 - length
        else:
            raise RuntimeError(f"could not fit sample {i} into {context_len - SLACK}..{context_len} tokens")
        samples.append(sample)
    return samples


def user_rows(samples: list[Sample]) -> list[dict]:
    """The rows as a user would write them: the four contract fields and nothing of ours."""
    return [{"id": s.id, "context": s.context, "question": s.question, "answers": s.answers} for s in samples]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context-len", type=int, required=True, help="prompt tokens at most (chat template included)")
    p.add_argument("--n", type=int, default=24, help="rows to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--backbone", default="smollm2-135m", help="whose tokenizer measures the prompts")
    p.add_argument("--out", type=Path, required=True, metavar="FILE.jsonl")
    args = p.parse_args(argv)
    if args.context_len < 256:
        raise SystemExit(f"--context-len {args.context_len}: use at least 256 tokens (the fact needs text around it)")
    from transformers import AutoTokenizer

    from residualkv.backbones import fetch_backbone

    tokenizer = AutoTokenizer.from_pretrained(fetch_backbone(args.backbone))
    samples = make_samples(tokenizer, args.context_len, args.n, args.seed)
    rows = user_rows(samples)
    write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} rows to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
