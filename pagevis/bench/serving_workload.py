"""`pagevis bench serve`'s users: two shared system prompts (each over 150 tokens), questions and follow-ups, and the
users who ask them (each level and round its own), for the bench's clients and for the engine alone
(serving_bare.py)."""

from __future__ import annotations

import random
import threading

from pagevis.simserver.workload import first_turn as chat_turn

SYSTEM_PROMPTS = (
    "You are the help desk of a small library that lends books, maps and recordings. Answer in two or three "
    "short sentences, plainly, without lists. The library opens at nine in the morning and closes at six in "
    "the evening, every day but Sunday. Members may borrow up to eight items at a time for three weeks, and "
    "may renew an item twice unless someone else has reserved it. Late items cost ten cents a day, and no "
    "more than the price of the item. Maps of the county and the old railway lines are kept in the reading "
    "room and do not leave the building. Recordings can be heard in the listening booths on the first floor. "
    "If a question is not about the library, say politely that you only know about the library and its "
    "collections, and suggest asking at the front desk.",
    "You are a patient tutor who explains how computers remember what they have just read. Keep every answer "
    "short: at most three sentences, in everyday words, with one small example when it helps. A language "
    "model reads text as tokens, and for every token it keeps a key and a value in each layer, so that the "
    "next token can look back at all of them without computing them again. That memory is called the key "
    "value cache. It grows with every token, so servers store it in fixed-size pages, share the pages of a "
    "prompt that many requests have in common, and drop or move old entries when memory runs short. When a "
    "student is confused, ask what they already know and build on it instead of repeating yourself.",
)
QUESTIONS = (
    "When can I come in on a Saturday?", "How many books can I take home?", "What happens if I return a map late?",
    "Can I renew a recording twice?", "Where do I listen to records?", "Do you have maps of the railway?",
    "Why does the model keep keys and values?", "What is a page in this cache?", "How do requests share pages?",
    "What happens when memory runs short?", "Is a token the same as a word?", "Why does the cache grow?",
    "Could you explain that with an example?", "What is the reading room for?", "Do you lend films as well?",
    "How much is the fine for a week?",
)
FOLLOW_UPS = ("Thanks. And on Sunday?", "Could you say that more simply?", "Why is that?", "And what about maps?",
              "What would you suggest then?", "Can you give another example?")


class Users:
    """Users in a fixed order (seeded): each has a system prompt, a question and a follow-up. A user's question
    opens with its reader number, `tag`-N, unique in the run (each level and round has its own tag): no level
    finds another level's users in the prefix cache (until session 13 a level reused the users of the level before
    it in the round, which shared its seed: 8 clients found one client's prompts cached), and every level's
    requests share with the cache what a user's do: the system prompts, and a returning user its first exchange."""

    def __init__(self, seed: int, tag: str = "0") -> None:
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.tag, self.count = tag, 0

    def next(self) -> tuple[int, str, str]:
        with self.lock:
            self.count += 1
            question = f"I am reader {self.tag}-{self.count}. {self.rng.choice(QUESTIONS)}"
            return self.rng.randrange(len(SYSTEM_PROMPTS)), question, self.rng.choice(FOLLOW_UPS)


def first_turn(system: int, question: str) -> list[dict]:
    return chat_turn(SYSTEM_PROMPTS[system], question)
