"""Built-in prompts for `swaserve train-drafter`: topics, the target's own questions, templates.

A drafter learns what the target says after the prompts it is trained on, and chat users ask
everything, in every form. Two seeded sources, mixed by data generation (drafter_data.py):

    the target's own   a numbered list the target continues ("Here are some questions that
    questions          people asked an AI assistant about {topic}:  1. {opener}", openers
                       from "How do I" to "Write a poem about"), or a chat request ("List 5
                       questions {asker} might ask about {topic}."), sampled; the items that
                       read as a user's message are kept (`parse_questions`), some dressed
                       with a greeting or an instruction (`dress`)
    templates          "{task}" x "{topic}" written here: a well-formed share

A small model writes better lists than single questions on request (measured on
smollm2-135m-instruct: asked for "a question a user might ask", it mostly answered instead).
`dedupe` drops repeats by a normalised key (case, punctuation and spacing ignored).
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

# fmt: off
TOPICS = [
    # science and nature
    "photosynthesis", "black holes", "volcanoes", "the water cycle", "prime numbers",
    "the immune system", "honeybees", "rainforests", "earthquakes", "the solar system",
    "dinosaurs", "ocean tides", "coral reefs", "glaciers", "the periodic table", "mushrooms",
    "the theory of evolution", "DNA", "gravity", "electricity", "magnets", "the speed of light",
    "climate change", "renewable energy", "wolves", "octopuses", "birds migrating",
    "the human brain", "the human heart", "sleep", "nutrition", "bacteria and viruses",
    "plate tectonics", "the moon", "Mars", "stars and galaxies", "chemistry experiments",
    "weather forecasting", "deserts", "rivers", "trees", "insects", "sharks", "elephants",
    "cats", "dogs", "horses", "genetics", "probability", "geometry", "algebra", "statistics",
    # technology and programming
    "machine learning", "neural networks", "the internet", "quantum computing",
    "sorting algorithms", "cryptography", "the blockchain", "robots", "3D printing",
    "electric cars", "smartphones", "cloud computing", "databases", "Python programming",
    "JavaScript", "web development", "Linux", "version control with git", "cybersecurity",
    "passwords", "recursion", "binary numbers", "operating systems", "computer networks",
    "spreadsheets", "APIs", "video games", "social media", "online privacy", "email etiquette",
    "unit testing", "regular expressions", "data visualisation", "SQL queries",
    "object-oriented programming", "linked lists", "hash tables", "compilers",
    # history and society
    "the Roman empire", "the French revolution", "ancient Egypt", "the Renaissance",
    "the printing press", "the Silk Road", "the moon landing", "the Industrial Revolution",
    "World War II", "the Cold War", "democracy", "elections", "human rights", "the United Nations",
    "ancient Greece", "the Vikings", "the Great Wall of China", "medieval castles",
    "the history of writing", "money and banking", "taxes", "inflation", "the stock market",
    "supply and demand", "globalisation", "urban planning", "public transport", "libraries",
    # everyday life
    "cooking pasta", "baking bread", "coffee", "tea", "chocolate", "spices", "vegetarian meals",
    "meal planning", "grocery shopping", "cleaning the house", "organising a small kitchen",
    "gardening", "houseplants", "moving to a new city", "renting an apartment", "home repairs",
    "budgeting", "saving for retirement", "credit cards", "buying a used car", "job interviews",
    "writing a resume", "working from home", "time management", "productivity", "procrastination",
    "public speaking", "making friends", "friendship", "parenting", "wedding planning",
    "birthday parties", "travel packing", "hiking", "camping", "travelling on a budget",
    "learning a language", "learning to play the guitar", "the piano", "photography",
    "painting", "knitting", "origami", "chess", "board games", "running a marathon",
    "yoga", "strength training", "meditation", "stress", "healthy habits", "drinking water",
    "first aid", "caring for a puppy", "adopting a cat", "recycling", "reducing waste",
    "volunteering", "customer service", "starting a small business", "marketing",
    "negotiating a salary", "team meetings", "giving feedback", "studying for exams",
    "writing an essay", "reading more books", "note taking", "online courses",
    # culture and arts
    "jazz music", "classical music", "Shakespeare", "poetry", "science fiction",
    "fairy tales", "mythology", "film making", "theatre", "architecture", "fashion",
    "the Olympic games", "football", "basketball", "tennis", "cycling", "swimming",
    "museums", "festivals around the world", "holidays", "comedy", "podcasts", "journaling",
    # places
    "Japan", "Italy", "Brazil", "Kenya", "Canada", "India", "Iceland", "Australia", "Mexico",
    "the Amazon river", "the Alps", "the Sahara", "Antarctica", "Paris", "New York City",
    "small towns", "islands", "mountains", "the ocean", "space travel",
]

# How a user's message may begin: the target continues a list whose first item starts so
OPENERS = [
    "How do I", "How can I", "How does", "How do", "How much", "How long", "Why", "Why do",
    "Why is", "What is", "What are", "What is the difference between", "What should I",
    "What happens if", "What is the best way to", "Can you explain", "Can you help me",
    "Can you give me", "Could you", "Is it true that", "Is it", "Should I", "Which", "When",
    "Where", "Who", "Explain", "Tell me", "Give me", "Describe", "Compare", "Summarise",
    "Suggest", "Recommend", "Write a", "Write a short story about", "Write a poem about",
    "Write a Python function that", "Write an email", "Help me", "I want to", "I need",
    "I'm trying to", "My", "List", "Create a", "Plan a", "Translate", "Solve", "What do you think",
]
# Who asks, for the chat-form list requests
ASKERS = [
    "a beginner", "a student", "a curious child", "a parent", "a traveller", "a programmer",
    "a teacher", "a small business owner", "a retired person", "a scientist", "a cook",
    "a new employee", "a writer", "a teenager", "someone on a tight budget",
]
_RAW = [
    "Here are some questions that people asked an AI assistant about {t}:\n\n1. {o}",
    "Here are some messages that users sent to an AI assistant about {t}:\n\n1. {o}",
    "Examples of requests a chatbot received about {t}:\n\n1. {o}",
]
_CHAT = [
    "List 5 questions {a} might ask about {t}.",
    "Write 5 questions people often ask about {t}, one per line.",
    "List 5 questions {a} might ask an AI assistant about {t}.",
]
# Ways users dress up a message: added to some generated questions
SUFFIXES = [
    " Please explain step by step.", " Keep it short.", " Give an example.",
    " Answer in one paragraph.", " Use a numbered list.", " Explain it simply.",
    " Please be detailed.", " Answer in three sentences.", " Why?", " Thanks!",
]
PREFIXES = ["Hi! ", "Quick question: ", "Hello, ", "I'm curious. ", "Please help. ", "Hey, "]
IMPERATIVES = {
    "write", "give", "explain", "tell", "list", "describe", "compare", "summarise", "summarize",
    "suggest", "recommend", "help", "create", "make", "plan", "draft", "show", "teach",
    "translate", "calculate", "solve", "design", "find", "name", "rewrite", "generate", "i",
    "i'm", "my", "please", "can", "could",
}

TASKS = [
    "Explain {t} to a curious twelve-year-old.",
    "Write a short story about {t}.",
    "List five facts about {t}, one per line.",
    "What are the pros and cons of {t}?",
    "Write a Python function related to {t}, with a docstring.",
    "Summarise the history of {t} in one paragraph.",
    "Give step-by-step instructions for getting started with {t}.",
    "Write a haiku and then a limerick about {t}.",
    "Compare {t} with something similar and explain the differences.",
    "Answer as a teacher: why does {t} matter?",
    "What are common misconceptions about {t}?",
    "Write a short dialogue between two friends discussing {t}.",
    "Describe {t} in three sentences.",
    "Write a blog post introduction about {t}.",
    "What questions would an expert ask about {t}? Answer two of them.",
    "Create a quiz with three multiple-choice questions about {t}.",
    "Explain how {t} works, using an analogy.",
    "Write a product description for something inspired by {t}.",
    "What would the world be like without {t}?",
    "Give a beginner's glossary of five terms related to {t}.",
    "I'm new to {t}. Where should I start?",
    "Tell me something surprising about {t}.",
    "Write a tweet about {t}.",
    "How would you teach {t} in a one-hour class?",
]



# fmt: on


@dataclass(frozen=True)
class QuestionRequest:
    """A prompt that makes the target write users' messages as a numbered list: `text` is
    raw text ending in "1. {opener}" (`chat` False, the target continues it) or a chat
    request (`chat` True, opener empty)."""

    text: str
    chat: bool
    opener: str


def question_requests(n: int, seed: int, chat_share: float = 0.3) -> list[QuestionRequest]:
    """n seeded requests over every topic, opener and asker."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        t = TOPICS[i % len(TOPICS)] if i < len(TOPICS) else rng.choice(TOPICS)
        if rng.random() < chat_share:
            text = rng.choice(_CHAT).format(a=rng.choice(ASKERS), t=t)
            out.append(QuestionRequest(text, True, ""))
        else:
            o = rng.choice(OPENERS)
            out.append(QuestionRequest(rng.choice(_RAW).format(t=t, o=o), False, o))
    return out


_ITEM = re.compile(r"^\s*(?:\d{1,2}\s*[.)]|[-*\u2022])\s+(.*)$")


def parse_questions(reply: str, opener: str = "") -> list[str]:
    """Users' messages in a generated numbered list: with an `opener`, the first line is item
    1 (its start was in the prompt) and is kept when plausible; other items only when they
    are questions or requests (`clean_message`)."""
    lines = reply.splitlines()
    items: list[tuple[str, bool]] = []
    if opener and lines:
        items.append((opener + lines[0], True))
        lines = lines[1:]
    for line in lines:
        m = _ITEM.match(line)
        if m:
            items.append((m.group(1), False))
    out = []
    for text, forced in items:
        q = clean_message(text, forced)
        if q is not None:
            out.append(q)
    return out


def clean_message(text: str, forced: bool = False) -> str | None:
    """One list item as a user's message, or None: quotes, markdown and a trailing " - note"
    removed; 3 to 60 words of mostly letters; a question, or (forced, or an imperative first
    word) a sentence."""
    t = text.strip().replace("**", "")
    if t[:1] in '"“' and re.search(r"[\"”]", t[1:]):
        t = re.split(r"[\"”]", t[1:])[0]
    t = t.split(" - ")[0].strip().strip("\"'“”`").strip()
    words = t.split()
    if not 3 <= len(words) <= 60 or not 12 <= len(t) <= 400 or t.endswith(":"):
        return None
    if sum(c.isalpha() or c == " " for c in t) < 0.8 * len(t) or "<|" in t:
        return None
    if re.search(r"\bAI assistant|\bchatbot", t, re.IGNORECASE):
        return None  # the list's heading talking, not a user
    if t.endswith("?"):
        return t
    first = words[0].lower().strip(",.!")
    if (forced or first in IMPERATIVES) and t[-1] in ".!)" and len(words) >= 4:
        return t
    return None


def dress(questions: list[str], share: float, seed: int) -> list[str]:
    """A `share` of the messages with a greeting before or an instruction after, seeded."""
    rng = random.Random(seed)
    out = []
    for q in questions:
        r = rng.random()
        if r < share / 2:
            q = rng.choice(PREFIXES) + q
        elif r < share:
            q = q + rng.choice(SUFFIXES)
        out.append(q)
    return out


def template_prompts(n: int, seed: int) -> list[str]:
    """n prompts "{task} about {topic}", seeded; every pair once before any repeats."""
    rng = random.Random(seed)
    pairs = [(task, topic) for task in TASKS for topic in TOPICS]
    rng.shuffle(pairs)
    return [task.format(t=topic) for task, topic in (pairs * (n // len(pairs) + 1))[:n]]


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9]+", " ", text.lower()).split())


def dedupe(texts: list[str]) -> list[str]:
    """Texts in order, each normalised key (case, punctuation, spacing ignored) once."""
    seen: set[str] = set()
    out = []
    for t in texts:
        key = normalise(t)
        if key and key not in seen:
            seen.add(key)
            out.append(t)
    return out
