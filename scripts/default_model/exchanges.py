"""Short instruction-style exchanges in the Llama 2 chat format.

Each turn is one ``<s>[INST] user [/INST] answer </s>`` segment, spelled as Meta's
``chat_completion`` spells it, so the chat mode's Llama 2 format produces exactly the prompts the
model was trained on. The segment texts here carry no ``<s>``/``</s>``: the trainer adds those as
token ids.
"""

from __future__ import annotations

import random

from default_model import stories
from default_model import vocabulary as V

SYSTEM_PROMPTS = [
    "You are a friendly storyteller for children.",
    "You are a helpful assistant. Keep your answers short.",
    "You tell short, happy stories.",
]

SOUNDS = {
    "cow": "moo", "dog": "woof", "cat": "meow", "duck": "quack", "sheep": "baa", "pig": "oink",
    "owl": "hoot", "lion": "roar", "frog": "ribbit", "bee": "buzz", "horse": "neigh",
    "chicken": "cluck", "mouse": "squeak", "wolf": "howl", "goat": "maa", "dove": "coo",
}


def turn(user: str, answer: str, system: str | None = None) -> str:
    if system:
        user = f"<<SYS>>\n{system}\n<</SYS>>\n\n{user}"
    return f"[INST] {user.strip()} [/INST] {answer.strip()} "


def story_request(rng: random.Random) -> tuple[str, str]:
    species = rng.choice(V.CREATURES)
    hero = stories.pick_hero(rng, species)
    x = f"{stories.article(hero.species)} {hero.species}"
    # The plain form is the one users type most; the others keep the model from overfitting to it.
    ask = rng.choice([
        f"Tell me a story about {x}", f"Tell me a story about {x}", f"Tell me a story about {x}",
        f"Tell me a story about {x}.", f"Tell me a short story about {x}.",
        f"Can you tell me a story about {x}?", f"Write a story about {x}.",
        f"Tell me a bedtime story about {x}.",
        f"Tell me a story about {stories.article(hero.adjective)} {hero.adjective} {hero.species}",
        f"Tell me a story about {x} named {hero.name}",
    ])
    return ask, stories.story(rng, hero)


def opening_request(rng: random.Random) -> tuple[str, str]:
    """A story asked for by its first words (what ``llama-chat -p "Once upon a time"`` sends)."""
    ask = rng.choice(["Once upon a time", "Once upon a time", "Once upon a time...", "Long ago",
                      "There once was", "Tell me a story", "Tell me a story.", "Tell me a story, please.",
                      "Write a story.", "Tell me a bedtime story."])
    openings = [o for o in stories.OPENINGS if o.startswith(ask.rstrip("."))] or stories.OPENINGS
    return ask, stories.story(rng, opening=rng.choice(openings))


def small_talk(rng: random.Random) -> tuple[str, str]:
    r = rng
    kind = r.randrange(7)
    if kind == 0:
        animal = r.choice(sorted(SOUNDS))
        return (f"What sound does {stories.article(animal)} {animal} make?",
                f"{stories.article(animal).capitalize()} {animal} says {SOUNDS[animal]}! {dict(V.CREATURES)[animal]}")
    if kind == 1:
        species, emoji = r.choice(V.CREATURES)
        return (f"What is the emoji for {stories.article(species)} {species}?",
                f"The emoji for {stories.article(species)} {species} is {emoji}.")
    if kind == 2:
        city, flag, hello = r.choice(V.CITIES)
        return (f"How do you say hello in {city}?", f"In {city} {flag} people say \"{hello}\".")
    if kind == 3:
        return (r.choice(["Hello", "Hello!", "Hi", "Hi!", "Good morning!"]),
                f"Hello!{' ' + r.choice(V.WAVES)} Would you like to hear a story?")
    if kind == 4:
        return (r.choice(["Who are you?", "What is your name?", "What can you do?"]),
                "I am a tiny story model 🤖. I can tell you short stories about animals, friends and faraway places.")
    if kind == 5:
        food, emoji = r.choice(V.FOODS)
        return ("What is your favorite food?", f"I like {food}{' ' + emoji if emoji else ''}. What do you like?")
    species, emoji = r.choice(V.CREATURES)
    return (f"Give me a fun fact about {stories.article(species)} {species}.",
            f"Here is a fun fact: every {species} {emoji} in my stories has a name and a best friend!")


def exchange(rng: random.Random) -> list[str]:
    """One conversation: a list of turns, each to be wrapped in ``<s>`` ... ``</s>``."""
    system = rng.choice(SYSTEM_PROMPTS) if rng.random() < 0.15 else None
    kind = rng.random()
    if kind < 0.55:
        user, answer = story_request(rng)
    elif kind < 0.75:
        user, answer = opening_request(rng)
    else:
        user, answer = small_talk(rng)
    turns = [turn(user, answer, system)]
    if rng.random() < 0.2:
        follow = rng.choice([
            ("Thank you!", "You are welcome! 😊 Sweet dreams."),
            ("Thanks", "You are welcome! Do you want another story?"),
            story_request(rng),
        ])
        turns.append(turn(*follow))
    return turns
