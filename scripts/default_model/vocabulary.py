"""The word lists the default model's corpus is made of.

Small on purpose: a model of a few million parameters can learn a few hundred characters, places,
objects and plot shapes well, and every emoji in it is one the tokenizer will spell as bytes. The
emoji cover what breaks naive streaming: plain 4-byte animals, VS16 variants (U+FE0F), skin tones,
flags (regional-indicator pairs) and zero-width-joiner sequences.
"""

from __future__ import annotations

# (species, emoji). The species is the X of "Tell me a story about a X".
CREATURES = [
    ("fox", "🦊"), ("rabbit", "🐰"), ("cat", "🐱"), ("dog", "🐶"), ("bear", "🐻"), ("owl", "🦉"),
    ("frog", "🐸"), ("mouse", "🐭"), ("lion", "🦁"), ("tiger", "🐯"), ("pig", "🐷"), ("cow", "🐮"),
    ("duck", "🦆"), ("penguin", "🐧"), ("turtle", "🐢"), ("fish", "🐟"), ("whale", "🐳"),
    ("dolphin", "🐬"), ("bee", "🐝"), ("butterfly", "🦋"), ("snail", "🐌"), ("horse", "🐴"),
    ("unicorn", "🦄"), ("dragon", "🐉"), ("monkey", "🐵"), ("elephant", "🐘"), ("giraffe", "🦒"),
    ("hedgehog", "🦔"), ("squirrel", "🐿️"), ("dove", "🕊️"), ("spider", "🕷️"), ("robot", "🤖"),
    ("chicken", "🐔"), ("wolf", "🐺"), ("koala", "🐨"), ("panda", "🐼"), ("octopus", "🐙"),
    ("crab", "🦀"), ("bird", "🐦"), ("deer", "🦌"), ("bat", "🦇"), ("hamster", "🐹"), ("goat", "🐐"),
    ("sheep", "🐑"), ("kangaroo", "🦘"), ("parrot", "🦜"), ("ladybug", "🐞"), ("zebra", "🦓"),
    ("wizard", "🧙"), ("princess", "👸"), ("pirate", "🏴‍☠️"), ("baker", "🧑‍🍳"), ("farmer", "🧑‍🌾"),
    ("astronaut", "🧑‍🚀"),
]

NAMES = [
    "Tom", "Lily", "Ben", "Mia", "Sam", "Anna", "Max", "Lucy", "Leo", "Emma", "Jack", "Rosa",
    "Finn", "Ella", "Oscar", "Ruby", "Milo", "Daisy", "Hugo", "Nina", "Theo", "Ivy", "Felix", "Luna",
    "Otto", "Maya", "Jasper", "Clara", "Noah", "Zara", "Eli", "Hazel", "Toby", "Poppy", "Arlo",
    "Iris", "Kai", "Nora", "Rex", "Willow", "Pip", "Sunny", "Bella", "Charlie", "Coco", "Olive",
    "Zoé", "José", "Chloé", "Renée", "Søren", "Björn", "Inés", "Amélie", "Yuki", "Aiko", "Mateo",
    "Lucía", "Ömer", "Zoë", "François", "Noémie",
]

ADJECTIVES = [
    "little", "brave", "shy", "curious", "happy", "sleepy", "clever", "kind", "tiny", "big",
    "grumpy", "silly", "gentle", "old", "young", "friendly", "quiet", "cheerful", "small", "funny",
]

# (place, emoji or "")
PLACES = [
    ("the forest", "🌲"), ("the river", ""), ("the meadow", "🌼"), ("a small village", "🏡"),
    ("the beach", "🏖️"), ("the mountain", "⛰️"), ("the garden", "🌷"), ("the farm", ""),
    ("the old castle", "🏰"), ("the big city", "🏙️"), ("the lake", ""), ("the park", "🌳"),
    ("the island", "🏝️"), ("the desert", "🌵"), ("the snowy hills", "❄️"), ("the jungle", "🌴"),
    ("the valley", ""), ("the old mill", ""), ("the cave", ""), ("the harbor", "⚓"),
    ("the library", "📚"), ("the school", "🏫"), ("the bakery", "🥖"), ("the market", ""),
]

# (city, flag, greeting in the local language). Used when a visitor arrives from far away.
CITIES = [
    ("Paris", "🇫🇷", "Bonjour"), ("Tokyo", "🇯🇵", "こんにちは"), ("Rome", "🇮🇹", "Ciao"),
    ("Madrid", "🇪🇸", "Hola"), ("Berlin", "🇩🇪", "Hallo"), ("Lisbon", "🇵🇹", "Olá"),
    ("Athens", "🇬🇷", "Γειά σου"), ("Beijing", "🇨🇳", "你好"), ("Sofia", "🇧🇬", "Здравей"),
    ("Mexico City", "🇲🇽", "Hola"), ("Nairobi", "🇰🇪", "Jambo"), ("Seoul", "🇰🇷", "안녕하세요"),
    ("Cairo", "🇪🇬", "مرحبا"), ("Oslo", "🇳🇴", "Hei"),
]

# (food, emoji or "")
FOODS = [
    ("apples", "🍎"), ("cake", "🍰"), ("bread", "🍞"), ("cookies", "🍪"), ("honey", "🍯"),
    ("pizza", "🍕"), ("soup", "🍲"), ("strawberries", "🍓"), ("carrots", "🥕"), ("cheese", "🧀"),
    ("ice cream", "🍦"), ("pancakes", "🥞"), ("a croissant", "🥐"), ("crème brûlée", ""),
    ("crêpes", ""), ("sushi", "🍣"), ("cherries", "🍒"), ("a banana", "🍌"), ("popcorn", "🍿"),
    ("lemonade", "🍋"), ("pie", "🥧"), ("nuts", "🥜"), ("jalapeño soup", ""), ("hot cocoa", "☕"),
]

# (object, emoji or "")
OBJECTS = [
    ("a red balloon", "🎈"), ("a kite", "🪁"), ("a book", "📖"), ("a blue hat", "🎩"),
    ("a golden key", "🔑"), ("an old map", "🗺️"), ("a shiny star", "⭐"), ("a seashell", "🐚"),
    ("a drum", "🥁"), ("a little bell", "🔔"), ("a toy boat", "⛵"), ("a bike", "🚲"),
    ("a gift", "🎁"), ("a pink flower", "🌸"), ("a tiny crown", "👑"), ("a piñata", "🪅"),
    ("a music box", "🎵"), ("a candle", "🕯️"), ("a compass", "🧭"), ("an umbrella", "☂️"),
    ("a ball", "⚽"), ("a magic wand", "🪄"), ("a lantern", "🏮"), ("a paper crown", ""),
    ("a wooden spoon", "🥄"), ("a green scarf", "🧣"), ("a glass jar", ""), ("a feather", "🪶"),
]

# (how the weather is told, emoji)
WEATHER = [
    ("the sun was shining", "☀️"), ("it was raining", "🌧️"), ("the wind was blowing", "🌬️"),
    ("snow was falling", "❄️"), ("the sky was full of clouds", "☁️"), ("a storm was coming", "⛈️"),
    ("a rainbow was in the sky", "🌈"), ("the moon was bright", "🌙"), ("it was a warm day", "🌞"),
]

# Gestures with skin-tone modifiers and hearts with VS16: the sequences a streamer must hold whole.
WAVES = ["👋", "👋🏻", "👋🏽", "👋🏿", "👍🏼", "👏🏾", "🙌🏽"]
HEARTS = ["❤️", "💛", "💚", "💙", "💜", "✨", "😊", "🥰", "🎉"]
FAMILIES = ["👨‍👩‍👧", "👨‍👩‍👧‍👦", "👩‍👩‍👦", "👨‍👧"]

FEELINGS = ["happy", "glad", "proud", "excited", "calm", "warm inside", "thankful"]
FEARS = ["the dark", "the loud thunder", "deep water", "the tall tree", "the big waves", "the old bridge"]
TIMES = ["One day", "One morning", "One evening", "One sunny afternoon", "Early one morning",
         "One cold winter day", "One spring morning", "Late one night"]
LESSONS = [
    "it is good to share with friends",
    "being kind is the best thing of all",
    "you can do hard things if you try",
    "friends help each other",
    "it is fine to ask for help",
    "a small act of kindness can make a big difference",
    "being brave means trying even when you are scared",
    "home is where the people you love are",
    "it is fun to learn new things",
    "saying sorry can fix a lot",
]
