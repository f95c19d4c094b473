"""Short children's stories from a handful of plot shapes, every choice drawn from one ``Random``.

A story opens by naming its hero's species ("there was a little fox named Tom"), so a model trained
on the chat exchanges learns to copy the X of "Tell me a story about a X" into its first sentence.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from default_model import vocabulary as V


@dataclass(frozen=True)
class Hero:
    name: str
    adjective: str
    species: str
    emoji: str
    pronoun: str  # "he" / "she"

    @property
    def possessive(self) -> str:
        return "his" if self.pronoun == "he" else "her"

    @property
    def object_pronoun(self) -> str:
        return "him" if self.pronoun == "he" else "her"


def article(word: str) -> str:
    return "an" if word[0].lower() in "aeiou" else "a"


def pick_hero(rng: random.Random, species: tuple[str, str] | None = None) -> Hero:
    kind, emoji = species or rng.choice(V.CREATURES)
    return Hero(rng.choice(V.NAMES), rng.choice(V.ADJECTIVES), kind, emoji, rng.choice(["he", "she"]))


OPENINGS = ["Once upon a time, there was", "Once upon a time there was", "Long ago, there was", "There once was"]


class Teller:
    """Writes one story; ``emoji`` decides how often an emoji follows the word it belongs to."""

    def __init__(self, rng: random.Random, emoji_rate: float, opening: str | None = None) -> None:
        self.rng = rng
        self.emoji_rate = emoji_rate
        self.opening = opening

    def e(self, emoji: str) -> str:
        """`` <emoji>`` or nothing, so the same sentence appears both with and without one."""
        if emoji and self.rng.random() < self.emoji_rate:
            return " " + emoji
        return ""

    def intro(self, hero: Hero, place: tuple[str, str]) -> str:
        r = self.rng
        opening = self.opening or r.choice(OPENINGS)
        where = r.choice([f" who lived in {place[0]}", f" who lived near {place[0]}", ""])
        return (f"{opening} {article(hero.adjective)} {hero.adjective} {hero.species} "
                f"named {hero.name}{self.e(hero.emoji)}{where}.")

    def friend(self, hero: Hero) -> Hero:
        while True:
            other = pick_hero(self.rng)
            if other.name != hero.name and other.species != hero.species:
                return other

    def ending(self, hero: Hero) -> list[str]:
        r = self.rng
        out = [r.choice([
            f"{hero.name} learned that {r.choice(V.LESSONS)}.",
            f"That night, {hero.name} went to sleep with a big smile{self.e(r.choice(V.HEARTS))}.",
            f"And from then on, {hero.name} was always {r.choice(V.FEELINGS)}{self.e(r.choice(V.HEARTS))}.",
            f"{hero.name} went home to {hero.possessive} family{self.e(r.choice(V.FAMILIES))} "
            f"and told them everything.",
        ])]
        if r.random() < 0.4:
            out.append("The end.")
        return out

    # --- plot shapes: each returns the sentences between the intro and the ending ---

    def lost_object(self, hero: Hero) -> list[str]:
        r = self.rng
        obj, obj_e = r.choice(V.OBJECTS)
        p1, p2 = r.sample(V.PLACES, 2)
        friend = self.friend(hero)
        return [
            f"{r.choice(V.TIMES)}, {hero.name} lost {hero.possessive} favorite toy, {obj}{self.e(obj_e)}.",
            f"{hero.pronoun.capitalize()} looked under the bed, behind the door and all over {p1[0]}.",
            f"{hero.name} felt sad and began to cry.",
            f"Then {friend.name} the {friend.species}{self.e(friend.emoji)} came by and said, \"I will help you!\"",
            f"Together they looked everywhere, and at last they found it near {p2[0]}{self.e(p2[1])}.",
            f"{hero.name} was so {r.choice(V.FEELINGS)} and said, \"Thank you, {friend.name}!\"",
        ]

    def new_friend(self, hero: Hero) -> list[str]:
        r = self.rng
        place, place_e = r.choice(V.PLACES)
        obj, obj_e = r.choice(V.OBJECTS)
        friend = self.friend(hero)
        return [
            f"{r.choice(V.TIMES)}, {hero.name} went to {place}{self.e(place_e)}.",
            f"There {hero.pronoun} met {article(friend.adjective)} {friend.adjective} {friend.species} "
            f"named {friend.name}{self.e(friend.emoji)}.",
            f"At first {friend.name} was shy and did not say a word.",
            f"{hero.name} smiled and waved{self.e(r.choice(V.WAVES))}.",
            f"\"Do you want to play with me?\" {hero.pronoun} asked.",
            f"They played with {obj}{self.e(obj_e)} until the sun went down.",
            f"From that day on, {hero.name} and {friend.name} were best friends{self.e(r.choice(V.HEARTS))}.",
        ]

    def trip(self, hero: Hero) -> list[str]:
        r = self.rng
        city, flag, hello = r.choice(V.CITIES)
        food, food_e = r.choice(V.FOODS)
        friend = self.friend(hero)
        return [
            f"{r.choice(V.TIMES)}, {hero.name} took a long train ride to {city}{self.e(flag)}.",
            f"Everything was new, and {hero.name} felt a little shy.",
            f"Then {article(friend.species)} {friend.species} named {friend.name} said, \"{hello}!\"",
            f"\"{hello}\" means hello, {friend.name} said with a smile{self.e(r.choice(V.WAVES))}.",
            f"They walked all around {city} and ate {food}{self.e(food_e)} together.",
            f"When it was time to go home, {hero.name} said \"{hello}\" one more time and waved goodbye.",
        ]

    def weather(self, hero: Hero) -> list[str]:
        r = self.rng
        w1, w1_e = r.choice(V.WEATHER[1:6])
        place, place_e = r.choice(V.PLACES)
        obj, obj_e = r.choice(V.OBJECTS)
        return [
            f"{r.choice(V.TIMES)}, {w1}{self.e(w1_e)}.",
            f"{hero.name} wanted to play in {place}, but {hero.pronoun} had to stay inside.",
            f"{hero.pronoun.capitalize()} looked out of the window and waited and waited.",
            f"To pass the time, {hero.pronoun} played with {obj}{self.e(obj_e)}.",
            f"After a while, the sun came out{self.e('☀️')} and a rainbow filled the sky{self.e('🌈')}.",
            f"{hero.name} ran outside to {place}{self.e(place_e)} and jumped in the puddles.",
        ]

    def baking(self, hero: Hero) -> list[str]:
        r = self.rng
        food, food_e = r.choice(V.FOODS)
        friend = self.friend(hero)
        return [
            f"{r.choice(V.TIMES)}, {hero.name} wanted to make {food}{self.e(food_e)} "
            f"for {friend.name} the {friend.species}.",
            f"{hero.pronoun.capitalize()} took a big bowl, a wooden spoon and some flour.",
            f"The kitchen got very messy, and there was flour on {hero.possessive} nose.",
            f"But at last the {food} was ready, and it smelled so good.",
            f"{hero.name} brought it to {friend.name}, who was very surprised{self.e(friend.emoji)}.",
            f"They shared the {food} and laughed together{self.e(r.choice(V.HEARTS))}.",
        ]

    def fear(self, hero: Hero) -> list[str]:
        r = self.rng
        fear = r.choice(V.FEARS)
        friend = self.friend(hero)
        return [
            f"{hero.name} was afraid of {fear}.",
            f"{r.choice(V.TIMES)}, {hero.name} had to face {fear} all alone.",
            f"{hero.possessive.capitalize()} legs were shaking, and {hero.pronoun} wanted to run away.",
            f"Then {hero.pronoun} remembered what {friend.name} the {friend.species}{self.e(friend.emoji)} "
            f"had said: \"Take a deep breath.\"",
            f"{hero.name} took a deep breath and took one small step, then another.",
            f"Soon {fear} did not seem so scary anymore{self.e(r.choice(V.WAVES))}.",
        ]

    def race(self, hero: Hero) -> list[str]:
        r = self.rng
        place, place_e = r.choice(V.PLACES)
        friend = self.friend(hero)
        return [
            f"{r.choice(V.TIMES)}, there was a big race in {place}{self.e(place_e)}.",
            f"{hero.name} wanted to win, but {friend.name} the {friend.species}{self.e(friend.emoji)} was very fast.",
            f"In the middle of the race, {friend.name} fell down and hurt {friend.possessive} leg.",
            f"{hero.name} stopped running and helped {friend.name} get up.",
            f"They crossed the finish line together, and everyone clapped{self.e(r.choice(V.WAVES))}.",
            f"Nobody remembered who won, but everybody remembered who helped.",
        ]

    def birthday(self, hero: Hero) -> list[str]:
        r = self.rng
        friend = self.friend(hero)
        obj, obj_e = r.choice(V.OBJECTS)
        food, food_e = r.choice(V.FOODS)
        return [
            f"{r.choice(V.TIMES)}, it was {friend.name}'s birthday{self.e('🎂')}.",
            f"{hero.name} wanted to give {friend.name} something special.",
            f"{hero.pronoun.capitalize()} found {obj}{self.e(obj_e)} and wrapped it in shiny paper{self.e('🎁')}.",
            f"At the party there was {food}{self.e(food_e)} and music, and everyone danced.",
            f"When {friend.name} opened the gift, {friend.pronoun} gave {hero.name} "
            f"a big hug{self.e(r.choice(V.HEARTS))}.",
        ]

    def bedtime(self, hero: Hero) -> list[str]:
        r = self.rng
        place, place_e = r.choice(V.PLACES)
        return [
            f"Late one night, {hero.name} could not fall asleep.",
            f"The moon was bright{self.e('🌙')} and the stars were twinkling{self.e('⭐')}.",
            f"{hero.pronoun.capitalize()} thought about {place} and all the friends who lived there.",
            f"{hero.possessive.capitalize()} mom sang a soft song and gave {hero.object_pronoun} "
            f"a warm hug{self.e(r.choice(V.FAMILIES))}.",
            f"Soon {hero.name} closed {hero.possessive} eyes and dreamed of {place}{self.e(place_e)}.",
        ]

    PLOTS = ("lost_object", "new_friend", "trip", "weather", "baking", "fear", "race", "birthday", "bedtime")

    def story(self, hero: Hero) -> str:
        r = self.rng
        place = r.choice(V.PLACES)
        body = getattr(self, r.choice(self.PLOTS))(hero)
        return " ".join([self.intro(hero, place), *body, *self.ending(hero)])


def story(rng: random.Random, hero: Hero | None = None, opening: str | None = None) -> str:
    """``opening`` (one of ``OPENINGS``) fixes how the first sentence begins."""
    # Most stories carry emoji, some none at all, so both kinds of text are normal to the model.
    rate = rng.choice([0.0, 0.3, 0.6, 0.9])
    return Teller(rng, rate, opening).story(hero or pick_hero(rng))
