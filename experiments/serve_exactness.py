"""Greedy texts of two running OpenAI-compatible servers at concurrency 1, 4 and 16: how many of 22 prompts (everyday
requests and Spec-Bench-shaped ones: multi-turn, translation, summarization, QA, math, RAG) differ from the first
server's concurrency-1 text. A verification run, not a test; its records live in experiments/results/serve_exactness/.

    adaflash serve --port 8101 &                      # the default server
    adaflash serve --port 8102 --drafter none &       # plain decoding of the same target
    python experiments/serve_exactness.py http://127.0.0.1:8101/v1 http://127.0.0.1:8102/v1 \
        --output experiments/results/serve_exactness/result.json
"""

import argparse
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from adaflash_hf.prepared.cpu import cpu_record

QUESTIONS = [
    "What is tea?",
    "Name three primary colors.",
    "Write a Python function that reverses a string.",
    "Give me a tip for sleeping better.",
    "Explain what a hash map is.",
    "Write a haiku about rain.",
    "Which planet is closest to the sun?",
    "List two uses of baking soda.",
    "How do I boil an egg?",
    "What does HTTP stand for?",
    "Suggest a name for a grey cat.",
    "Why is the sky blue?",
    "Write a short email asking my landlord to fix the heating.",
    "What are the benefits of walking every day?",
    "Translate into German: The train leaves at seven and arrives in Berlin at noon.",
    "Summarize: The city council voted to extend the bike lane network by 40 km over three years, funded by a parking "
    "levy; opponents argued shops would lose customers.",
    "Q: Who wrote Pride and Prejudice? A:",
    "A shop sells pens at 3 dollars each. Anna buys 7 pens and pays with a 50 dollar note. How much change does she "
    "get?",
    "Context: The Amazon river flows through Peru, Colombia and Brazil and discharges more water than any other river. "
    "Question: Which countries does the Amazon flow through?",
    "Is 97 a prime number? Explain briefly.",
    "Translate into Spanish: I would like a table for two by the window, please.",
]
CONVERSATIONS = [[{"role": "user", "content": q}] for q in QUESTIONS] + [
    [
        {"role": "user", "content": "I am planning a trip to Japan."},
        {"role": "assistant", "content": "Great! When are you going and what do you like to do?"},
        {"role": "user", "content": "In April. I like food and temples. Suggest a three-day plan."},
    ]
]


def texts(base_url: str, model: str, concurrency: int, max_tokens: int) -> list[str]:
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)

    def ask(messages):
        reply = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0
        )
        return reply.choices[0].message.content

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(ask, CONVERSATIONS))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "servers", nargs="+", help="base URLs (…/v1); the first one's concurrency-1 texts are the reference"
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    runs = {
        f"{url}@{level}": texts(url, args.model, level, args.max_tokens)
        for url in args.servers
        for level in args.concurrency
    }
    reference = next(iter(runs.values()))
    differing = {run: sum(a != b for a, b in zip(found, reference)) for run, found in runs.items()}
    print(json.dumps(differing, indent=1))
    if args.output is not None:
        record = {"cpu": cpu_record(), "prompts": len(CONVERSATIONS), "differing": differing, "texts": runs}
        args.output.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
