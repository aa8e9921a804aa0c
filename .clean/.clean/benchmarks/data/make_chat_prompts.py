"""Writes chat_train.jsonl: the prompts the committed SmolLM2 DFlash2 drafter was distilled on.

Requests a chat user might send: request shapes x subjects, then one request per word of the
target's own vocabulary (whole lowercase words of 5-14 letters), for breadth. The held-out prompts of
chat_heldout.jsonl were written separately by hand, with other wording and other subjects, so
the acceptance they report is on text the drafter never saw.
Run: python benchmarks/data/make_chat_prompts.py (deterministic).
"""
import json
import random
import re
from pathlib import Path

SUBJECTS = """the water cycle; photosynthesis; black holes; volcanoes; earthquakes; the immune system; vaccines;
DNA; evolution; climate change; renewable energy; solar panels; wind turbines; nuclear power; electric cars;
batteries; the internet; email; passwords; cloud computing; machine learning; neural networks; databases;
spreadsheets; recursion; binary numbers; prime numbers; fractions; percentages; compound interest; budgeting;
saving money; inflation; the stock market; taxes; credit cards; renting an apartment; buying a house;
job interviews; writing a resume; public speaking; time management; procrastination; meditation; sleep;
healthy breakfast; drinking water; running; yoga; strength training; stretching; the Roman Empire;
ancient Egypt; the Renaissance; the Industrial Revolution; the printing press; the French Revolution;
the Silk Road; the Vikings; the Great Wall of China; the Olympic Games; football; basketball; tennis; chess;
jazz; classical music; learning the guitar; painting with watercolors; photography; gardening; tomatoes;
houseplants; composting; bees; dolphins; elephants; octopuses; migrating birds; coral reefs; rainforests;
deserts; the Arctic; the Moon; Mars; the Sun; comets; telescopes; rockets; airplanes; trains; bicycles;
bread baking; pasta; soup; coffee; tea; chocolate; cheese; vegetarian cooking; food safety; leftovers;
camping; hiking; packing for a trip; visiting Japan; visiting Italy; learning Spanish; learning to read;
homework; exams; online courses; libraries; writing a novel; poetry; fairy tales; Shakespeare; journaling;
friendship; moving to a new city; adopting a dog; cats; aquariums; recycling; plastic pollution; clean air;
first aid; colds and flu; allergies; sunscreen; dentists; eyesight; the human heart; the brain; bones;
robots; smartphones; video games; social media; online privacy; open source software; Python; JavaScript;
HTML; Git; the command line; unit tests; debugging; APIs; weather forecasts; rainbows; tides; magnets;
electricity; light; sound; gravity; friction; chemistry at home; soap; cleaning the kitchen; laundry;
small businesses; marketing; customer service; teamwork; leadership; negotiation; saying no politely""".split(";")

SHAPES = [
    "Explain {s} in simple terms.",
    "What is {s}?",
    "Give me three interesting facts about {s}.",
    "Write a short paragraph about {s}.",
    "How would you explain {s} to a ten-year-old?",
    "What are the pros and cons of {s}?",
    "Write a short poem about {s}.",
    "List five tips about {s}.",
    "Summarize the most important ideas about {s}.",
    "Why does {s} matter?",
    "What are common misconceptions about {s}?",
    "Write a short story that involves {s}.",
    "Give me a step-by-step guide related to {s}.",
    "What questions should a beginner ask about {s}?",
    "Describe {s} in one paragraph, then give an example.",
    "Write a friendly email to a colleague about {s}.",
    "What is the history of {s}?",
    "Compare {s} with something similar and explain the differences.",
    "Create a short quiz with three questions about {s}.",
    "What would happen if {s} did not exist?",
    "Write a tweet about {s}.",
    "I am curious about {s}. Where should I start?",
]

WORD_SHAPES = [
    "What does the word '{s}' mean? Use it in a sentence.",
    "Tell me something interesting related to {s}.",
    "Write a short paragraph that uses the word '{s}'.",
    "Can you explain the idea of {s} with an example?",
    "Write a two-line poem about {s}.",
    "Give me a fun fact connected to {s}.",
    "How would you describe {s} to a friend?",
    "Write a short story in three sentences about {s}.",
]

CODE = [
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that counts the words in a sentence.",
    "Write a Python function that returns the largest number in a list.",
    "Write a Python function that computes the factorial of n.",
    "Write a Python function that removes duplicates from a list while keeping the order.",
    "Write a Python function that checks whether a word is a palindrome.",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Write a Python function that merges two sorted lists.",
    "Write a Python function that returns the Fibonacci numbers below n.",
    "Write a JavaScript function that sums an array of numbers.",
    "Write a JavaScript function that capitalizes every word in a string.",
    "Write a SQL query that selects the ten newest orders from a table called orders.",
    "Write a bash command that counts the lines in every .txt file in a folder.",
    "Write an HTML page with a title and a button.",
    "Explain what this Python code does: print(sum(x * x for x in range(10)))",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Write a Python function that reads a CSV file and prints each row.",
    "Write a Python script that prints a multiplication table from 1 to 9.",
    "Write a Python function that sorts a list of dictionaries by the key 'age'.",
]


def vocabulary_words() -> list[str]:
    from pressroom.model.loader import load_tokenizer, resolve_model_path
    vocab = load_tokenizer(resolve_model_path(None)).get_vocab()  # the embedded SmolLM2's
    return sorted({t[1:] for t in vocab if t.startswith("\u0120") and re.fullmatch(r"[a-z]{5,14}", t[1:])})


def main() -> None:
    rng = random.Random(0)
    subjects = [s.strip() for s in SUBJECTS if s.strip()]
    prompts = [shape.format(s=s) for s in subjects for shape in SHAPES] + CODE
    prompts += [rng.choice(WORD_SHAPES + SHAPES).format(s=w) for w in vocabulary_words()]
    rng.shuffle(prompts)
    out = Path(__file__).with_name("chat_train.jsonl")
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    print(f"{len(prompts)} prompts -> {out}")


if __name__ == "__main__":
    main()
