"""short-answer: everyday questions with a one-word answer; reward = correct and brief.

The demo task. A small instruct model knows most answers but wraps them in sentences, so the
base policy scores low and GRPO has a clear, fast signal to learn from on a CPU: say the right
word, and only the word. Offline: the questions ship with the code.
"""

from __future__ import annotations

import random
import re

from grpo.envs.base import check_num_examples
from grpo.envs.single_turn import SingleTurnEnv

SYSTEM_PROMPT = "Answer with one word only."

QUESTIONS: list[tuple[str, str]] = [
    ("What is the capital of France?", "Paris"),
    ("What is the capital of Italy?", "Rome"),
    ("What is the capital of Japan?", "Tokyo"),
    ("What is the capital of Spain?", "Madrid"),
    ("What is the capital of Germany?", "Berlin"),
    ("What is the capital of England?", "London"),
    ("What is the capital of Russia?", "Moscow"),
    ("What is the capital of Egypt?", "Cairo"),
    ("What color is the sky on a clear day?", "blue"),
    ("What color is grass?", "green"),
    ("What color is snow?", "white"),
    ("What color is a ripe banana?", "yellow"),
    ("What color is coal?", "black"),
    ("What color is a ripe tomato?", "red"),
    ("Which animal barks?", "dog"),
    ("Which animal meows?", "cat"),
    ("Which animal says moo?", "cow"),
    ("Which animal has a trunk?", "elephant"),
    ("Which bird hoots at night?", "owl"),
    ("Which animal is known as the king of the jungle?", "lion"),
    ("What is the opposite of hot?", "cold"),
    ("What is the opposite of up?", "down"),
    ("What is the opposite of big?", "small"),
    ("What is the opposite of day?", "night"),
    ("What is the opposite of fast?", "slow"),
    ("What is the opposite of open?", "closed"),
    ("What is the opposite of wet?", "dry"),
    ("What is the opposite of happy?", "sad"),
    ("What do bees make?", "honey"),
    ("What do cows drink?", "water"),
    ("What is frozen water called?", "ice"),
    ("Which planet do we live on?", "Earth"),
    ("What is the closest star to Earth?", "Sun"),
    ("What shines in the sky at night and has phases?", "Moon"),
    ("How many legs does a spider have? Answer with a number word.", "eight"),
    ("How many days are in a week? Answer with a number word.", "seven"),
    ("How many wheels does a bicycle have? Answer with a number word.", "two"),
    ("What is two plus two? Answer with a number word.", "four"),
    ("What is the largest ocean on Earth?", "Pacific"),
    ("What season comes after winter?", "spring"),
    ("What season comes after summer?", "autumn"),
    ("Which month comes after January?", "February"),
    ("Which day comes after Monday?", "Tuesday"),
    ("What do you call a baby dog?", "puppy"),
    ("What do you call a baby cat?", "kitten"),
    ("What fruit keeps the doctor away?", "apple"),
    ("What gas do humans breathe in to live?", "oxygen"),
    ("What do plants need from the sun to grow?", "light"),
    ("Which metal is yellow and precious?", "gold"),
    ("What is the main language spoken in Brazil?", "Portuguese"),
    ("What is the main language spoken in Mexico?", "Spanish"),
    ("Which instrument has black and white keys?", "piano"),
    ("What do you use to write on a blackboard?", "chalk"),
    ("Which sense do you use your nose for?", "smell"),
    ("Which sense do you use your ears for?", "hearing"),
    ("What is the tallest animal?", "giraffe"),
    ("What is the fastest land animal?", "cheetah"),
    ("Which insect makes a web?", "spider"),
    ("What do caterpillars turn into?", "butterfly"),
]

_WORD = re.compile(r"[A-Za-z0-9']+")


def short_answer_reward(completion: str, answer: str) -> float:
    """Half for naming the answer, half for brevity (1 for one word, 1/n for n words)."""
    words = _WORD.findall(completion)
    if not words:
        return 0.0
    correct = any(w.lower() == answer.lower() for w in words)
    return 0.5 * correct + 0.5 / len(words)


def load_environment(num_examples: int = 1000, seed: int = 0) -> SingleTurnEnv:
    return one_word_questions("short-answer", SYSTEM_PROMPT, num_examples, seed)


def one_word_questions(name: str, system_prompt: str, num_examples: int, seed: int) -> SingleTurnEnv:
    """`num_examples` questions drawn from QUESTIONS (seeded), scored by short_answer_reward, asked
    under `system_prompt`."""
    check_num_examples(name, num_examples)
    rng = random.Random(seed)
    examples = [
        {"prompt": question, "answer": answer, "task": name}
        for question, answer in (rng.choice(QUESTIONS) for _ in range(num_examples))
    ]
    return SingleTurnEnv(
        examples=examples, rewards=[short_answer_reward], system_prompt=system_prompt, name=name
    )
