"""`pressroom make-prompts`: training prompts for a drafter, written by the target model itself.

A drafter learns the target's own continuations, so what matters is the variety of the requests it
sees. The target continues numbered lists of requests people sent to an assistant (a heading naming
the kind and topic, two examples; sampled at temperature 0.8 from the engine's seed: a small model
imitates a format better than it follows an instruction), across topics x task types: questions,
code, maths word problems, summaries of a paragraph the model wrote first, rewrites, advice,
explanations, and multi-turn conversations (a question, the target's own greedy answer through its
chat template, then a follow-up the model writes). The results are cleaned (first line, quotes and
labels stripped, length bounds, answers in an assistant's voice dropped), de-duplicated on their
normalised words, and kept apart from held-out prompts: none shares a run of 8 words with any of them
(or is one of them), so an acceptance length measured on those stays a held-out figure.

Output: JSONL, `{"prompt": text}` per single-turn request, `{"messages": [...]}` per conversation (the
user turns and the target's answers, ending with a user turn): what `train-drafter --chat` reads.
"""
from __future__ import annotations

import json
import logging
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass

logger = logging.getLogger("pressroom")

TOPICS = """cooking dinner, baking bread, gardening, houseplants, personal finance, saving for retirement,
job interviews, writing a resume, learning a language, travel in Japan, travel on a budget, camping,
hiking safety, dog training, cat health, raising toddlers, teenagers and phones, sleep, running,
strength training, nutrition, meditation, stress at work, time management, public speaking,
negotiating a salary, starting a small business, marketing on social media, customer service,
photography, drawing, learning guitar, music theory, film history, classic novels, poetry, chess,
board games, video game design, astronomy, black holes, climate change, renewable energy,
electric cars, bicycles, home repair, plumbing, painting a room, moving house, renting an apartment,
buying a car, insurance, taxes, law for tenants, first aid, the common cold, allergies, dentistry,
ancient Rome, ancient Egypt, the Renaissance, World War II, the Cold War, the history of computing,
the internet, cybersecurity, passwords, Python programming, JavaScript, SQL databases, Linux commands,
git, machine learning, statistics, probability, algebra, geometry, calculus, physics of motion,
electricity, chemistry in the kitchen, biology of cells, genetics, evolution, the human brain,
psychology of habits, philosophy of mind, ethics, economics, inflation, supply and demand,
geography of Africa, oceans, volcanoes, weather forecasts, birds, insects, marine life, dinosaurs,
space exploration, architecture, interior design, fashion, knitting, woodworking, 3D printing,
electronics for beginners, robotics, smartphones, email etiquette, writing a cover letter,
planning a wedding, parenting, friendship, moving abroad, volunteering, recycling, minimalism,
coffee, tea, wine, vegetarian recipes, meal planning, board meetings, project management, remote work,
spreadsheets, data visualisation, accounting basics, the stock market, cryptocurrencies,
mythology, religions of the world, languages and dialects, sign language, sports rules, football,
basketball, tennis, swimming, yoga, the Olympics, mountaineering, sailing, fishing, road trips""".split(",")

LANGUAGES = ("Python", "JavaScript", "SQL", "Bash", "C", "Rust", "Go", "Java", "TypeScript", "HTML and CSS")

# Task type -> how the list of requests is introduced ({topic}, {language} filled in).
TASKS: dict[str, tuple[str, ...]] = {
    "question": ("questions people asked an AI assistant about {topic}",
                 "short questions beginners asked about {topic}"),
    "advice": ("messages in which people describe a problem with {topic} and ask for advice",),
    "explain": ("requests asking an assistant to explain something about {topic} simply",
                "requests asking an assistant to compare two things related to {topic}"),
    "code": ("requests for short {language} programs, some related to {topic}",
             "questions about errors people hit while writing {language} code"),
    "maths": ("maths word problems about {topic} that students asked for help with",
              "arithmetic and algebra exercises students asked for help with"),
    "creative": ("requests for a short poem, story or slogan about {topic}",
                 "requests for lists of ideas about {topic}"),
    "rewrite": ("requests to rewrite, shorten or make more polite a sentence, each quoting the sentence",),
}
# The list's first two items (two drawn per request); written for this file, none of them near the
# held-out prompts.
EXAMPLES: dict[str, tuple[str, ...]] = {
    "question": ("Why does bread go stale faster in the fridge?", "How far away is the nearest star?",
                 "What is the difference between a virus and a bacterium?",
                 "Is it better to rent or buy a house when prices are high?"),
    "advice": ("My neighbour's dog barks all night and I can't sleep. What should I do?",
               "I keep forgetting to water my plants. Any tips?",
               "I have an interview on Monday and I'm nervous. How can I prepare?"),
    "explain": ("Can you explain how vaccines train the immune system?", "Explain compound interest like I'm ten.",
                "What is the difference between weather and climate?"),
    "code": ("Write a Python function that counts the vowels in a string.",
             "How do I reverse a list in JavaScript without changing the original?",
             "Why does my SQL query return duplicate rows after a JOIN?"),
    "maths": ("A shop sells pens at 3 for $2. How much do 12 pens cost?",
              "Solve for x: 3x + 7 = 22.",
              "A train travels 180 km in 2 hours and 30 minutes. What is its average speed?"),
    "creative": ("Write a short poem about the first snow of winter.",
                 "Give me five name ideas for a bakery that sells only pies.",
                 "Write a slogan for a bicycle repair shop."),
    "rewrite": ("Make this sentence more polite: 'Send me the report now.'",
                "Shorten this: 'In the event that it rains, the picnic will be moved indoors to the hall.'",
                "Rewrite this for a child: 'Photosynthesis converts light energy into chemical energy.'"),
}
_ASSISTANT_VOICE = re.compile(r"^(?:sure|certainly|of course|absolutely|i'm ready|i am ready|i'm sorry|i am sorry|"
                              r"here is|here's|as an ai|great question|hello|hi there|hey there)\b", re.I)
SUMMARY_SOURCE = "Here is a short, clear paragraph about {topic}, written for a general audience.\n\n"
SUMMARY_ASKS = ("Summarize the following text in two sentences:\n\n{text}",
                "What is the main point of this paragraph?\n\n{text}",
                "Give me three key facts from this text:\n\n{text}", "TL;DR:\n\n{text}")
FOLLOW_UP = "A conversation with an AI assistant.\n\nUser: {question}\n\nAssistant: {answer}\n\nUser:"
KINDS = (*TASKS, "summary", "multi_turn")

_LABEL = re.compile(r"^\s*(?:question|request|problem|message|user|exercise|prompt)\s*\d*\s*:\s*", re.I)
_WORD = re.compile(r"[a-z0-9]+")
_SHINGLE = 8  # words: a run this long shared with a held-out prompt excludes a candidate


@dataclass(slots=True)
class Request:
    """One text for the target to continue, and what becomes of its continuation."""
    kind: str
    topic: str
    instruction: str


def clean(text: str, min_chars: int = 12, max_chars: int = 600) -> str | None:
    """The request out of a model's answer: labels and wrapping quotes off, within length bounds (a summary
    source keeps its paragraphs; a request keeps its first paragraph)."""
    text = text.strip()
    text = _LABEL.sub("", text.split("\n\n")[0]).strip().strip('"“”').strip()
    if not (min_chars <= len(text) <= max_chars) or not any(c.isalpha() for c in text):
        return None
    if _ASSISTANT_VOICE.match(text):  # the model answered as an assistant instead of writing a request
        return None
    return text


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class Exclusion:
    """Held-out prompts to stay away from: their normalised texts and every run of `_SHINGLE` words."""

    def __init__(self, texts: Iterable[str]) -> None:
        self.exact: set[str] = set()
        self.shingles: set[tuple[str, ...]] = set()
        for t in texts:
            w = words(t)
            self.exact.add(" ".join(w))
            self.shingles.update(_shingles(w))

    def excludes(self, text: str) -> bool:
        w = words(text)
        return " ".join(w) in self.exact or any(s in self.shingles for s in _shingles(w))


def _shingles(w: list[str]) -> Iterable[tuple[str, ...]]:
    return (tuple(w[i:i + _SHINGLE]) for i in range(max(0, len(w) - _SHINGLE + 1)))


def plan_requests(count: int, seed: int) -> list[Request]:
    """`count` meta-requests, task types in turn (so every kind is represented), topics and wordings drawn."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        kind, topic = KINDS[i % len(KINDS)], rng.choice(TOPICS).strip()
        if kind == "summary":
            out.append(Request(kind, topic, SUMMARY_SOURCE.format(topic=topic)))
            continue
        like = "question" if kind == "multi_turn" else kind
        heading = rng.choice(TASKS[like]).format(topic=topic, language=rng.choice(LANGUAGES))
        shown = rng.sample(EXAMPLES[like], 2)
        # A numbered list the model continues: a small model imitates a format better than it follows an
        # instruction to write one.
        out.append(Request(kind, topic, f"Some {heading}:\n\n1. {shown[0]}\n2. {shown[1]}\n3."))
    return out


def make_prompts(llm, num_prompts: int, exclude: Iterable[str] = (), seed: int = 0, batch: int = 1024,
                 max_tokens: int = 96, answer_tokens: int = 128, max_rounds: int = 50) -> list[dict]:
    """`num_prompts` distinct training prompts written by the model (JSONL records, see the module's doc).
    Rounds of `batch` meta-requests until enough survive cleaning, de-duplication and the exclusion."""
    exclusion = Exclusion(exclude)
    seen: set[str] = set()
    records: list[dict] = []
    for round_no in range(max_rounds):
        if len(records) >= num_prompts:
            break
        requests = plan_requests(batch, seed * 1_000_003 + round_no)
        texts = _write(llm, [r.instruction for r in requests], max_tokens)
        texts = [t if r.kind == "summary" else t.split("\n")[0] for r, t in zip(requests, texts)]  # list item 3
        conversations = []
        for req, text in zip(requests, texts):
            record = _record(req, text, round_no)
            if record is None:
                continue
            key = " ".join(words(_user_text(record)))
            if key in seen or exclusion.excludes(_user_text(record)):
                continue
            seen.add(key)
            (conversations if req.kind == "multi_turn" else records).append(record)
        records += _continue_conversations(llm, conversations, answer_tokens, max_tokens, exclusion, seen)
        logger.info("make-prompts: round %d, %d prompts", round_no + 1, len(records))
    else:
        if len(records) < num_prompts:
            raise ValueError(f"Only {len(records)} distinct prompts after {max_rounds} rounds: the model repeats "
                             "itself; ask for fewer or raise the batch.")
    random.Random(seed).shuffle(records)  # kinds mixed, conversations (written after each round) included
    return records[:num_prompts]


def _record(req: Request, text: str, round_no: int) -> dict | None:
    if req.kind == "summary":
        source = clean(text.strip(), min_chars=120, max_chars=1500)
        if source is None:
            return None
        ask = SUMMARY_ASKS[(round_no + len(source)) % len(SUMMARY_ASKS)]
        return {"prompt": ask.format(text=source), "kind": req.kind}
    text = clean(text)
    if text is None:
        return None
    if req.kind == "multi_turn":
        return {"messages": [{"role": "user", "content": text}], "kind": req.kind}
    return {"prompt": text, "kind": req.kind}


def _user_text(record: dict) -> str:
    if "prompt" in record:
        return record["prompt"]
    return "\n".join(m["content"] for m in record["messages"] if m["role"] == "user")


def _continue_conversations(llm, conversations: list[dict], answer_tokens: int, max_tokens: int,
                            exclusion: Exclusion, seen: set[str]) -> list[dict]:
    """Each first question gets the target's greedy answer, then a follow-up the model writes itself."""
    from pressroom import SamplingParams
    if not conversations:
        return []
    answers = llm.chat([c["messages"] for c in conversations],
                       SamplingParams(temperature=0, max_tokens=answer_tokens), use_tqdm=False)
    asks = [FOLLOW_UP.format(question=c["messages"][0]["content"], answer=" ".join(a.outputs[0].text.split()))
            for c, a in zip(conversations, answers)]
    follow_ups = _write(llm, asks, max_tokens, stop=["\n"])
    out = []
    for conv, answer, follow in zip(conversations, answers, follow_ups):
        follow = clean(follow)
        if follow is None or exclusion.excludes(follow):
            continue
        conv["messages"] += [{"role": "assistant", "content": answer.outputs[0].text.strip()},
                             {"role": "user", "content": follow}]
        key = " ".join(words(_user_text(conv)))
        if key not in seen:
            seen.add(key)
            out.append(conv)
    return out


def _write(llm, texts: list[str], max_tokens: int, stop: list[str] | None = None) -> list[str]:
    """The model's sampled continuation of each text. The engine's generator (EngineArgs.seed) draws the
    noise: per-request seeds would draw each row's noise apart, on the host, every step of a 2,048-row batch."""
    from pressroom import SamplingParams
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=max_tokens, stop=stop)
    outs = llm.generate(texts, params, use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def read_training_prompts(path: str) -> list[str | list[dict]]:
    """A training file's prompts: texts, and conversations (`{"messages": [...]}` records)."""
    from pressroom.benchmarks.workload import read_prompt_texts
    with open(path) as f:
        if not any('"messages"' in line for line in f):
            return list(read_prompt_texts(path))
    out: list[str | list[dict]] = []
    with open(path) as f:
        for line in f:
            if line.strip():
                rec = json.loads(line)
                out.append(rec["messages"] if "messages" in rec else rec["prompt"])
    return out


def run_cli(args, engine_kwargs: dict) -> int:
    from pressroom import LLM
    from pressroom.benchmarks.workload import read_prompt_texts
    exclude = [t for path in args.exclude for t in read_prompt_texts(path)]
    llm = LLM(**engine_kwargs)
    records = make_prompts(llm, args.num_prompts, exclude, args.seed or 0, args.batch, args.max_tokens)
    with open(args.output, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    kinds = {k: sum(r["kind"] == k for r in records) for k in KINDS}
    print(json.dumps({"prompts": len(records), "output": args.output, "kinds": kinds}))
    return 0
