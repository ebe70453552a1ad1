"""Prompt sets for the load tests, reproducible from a seed and free of any data set download.

  synthetic      random common words; lengths log-normal (median 60 words, clipped to 4..400), raw text
  chat           short natural-language questions, sent with the model's chat template
  shared-system  one long common instruction block + a varied question: every request shares a prefix of
                 several hundred tokens, which the engine's prefix cache should serve after the first
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool  # send with apply_chat_template (the ensemble wraps the text as one user turn)


WORDS = """the of and to in is it you that he was for on are with as his they be at one have this from or
had by word but what some we can out other were all there when up use your how said an each she which do
their time if will way about many then them write would like so these her long make thing see him two has
look more day could go come did number sound no most people my over know water than call first who may
down side been now find any new work part take get place made live where after back little only round man
year came show every good me give our under name very through just form sentence great think say help low
line differ turn cause much mean before move right boy old too same tell does set three want air well also
play small end put home read hand port large spell add even land here must big high such follow act why ask
men change went light kind off need house picture try us again animal point mother world near build self
earth father head stand own page should country found answer school grow study still learn plant cover food
sun four between state keep eye never last let thought city tree cross farm hard start might story saw far
sea draw left late run while press close night real life few north open seem together next white children
begin got walk example ease paper group always music those both mark often letter until mile river car feet
care second book carry took science eat room friend began idea fish mountain stop once base hear horse cut
sure watch color face wood main enough plain girl usual young ready above ever red list though feel talk
bird soon body dog family direct pose leave song measure door product black short numeral class wind
question happen complete ship area half rock order fire south problem piece told knew pass since top whole
king space heard best hour better true during hundred five remember step early hold west ground interest
reach fast verb sing listen six table travel less morning ten simple several vowel toward war lay against
pattern slow center love person money serve appear road map rain rule govern pull cold notice voice unit
power town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
correct able pound done beauty drive stood contain front teach week final gave green oh quick develop ocean
warm free minute strong special mind behind clear tail produce fact street inch multiply nothing course
stay wheel full force blue object decide surface deep moon island foot system busy test record boat common
gold possible plane stead dry wonder laugh thousand ago ran check game shape equate hot miss brought heat
snow tire bring yes distant fill east paint language among""".split()

QUESTIONS = [
    "What is the capital of France?",
    "How do vaccines train the immune system?",
    "Explain the difference between weather and climate.",
    "Why is the sky blue during the day?",
    "Write a haiku about autumn leaves.",
    "What are three tips for sleeping better?",
    "How does a bicycle stay upright when it moves?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "What is a prime number? Give two examples.",
    "How do I boil an egg so the yolk stays soft?",
    "Why do cats purr?",
    "What causes the seasons on Earth?",
    "Give me a short motivational quote for a Monday morning.",
    "How does compound interest work?",
    "What is the difference between a list and a tuple in Python?",
    "Name three famous paintings and their painters.",
    "How can I make my houseplants grow faster?",
    "What does a GPU do that a CPU does not?",
    "Explain photosynthesis to a ten-year-old.",
    "What should I pack for a weekend hiking trip?",
    "Why do we have leap years?",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is the tallest mountain in the world, and how tall is it?",
    "How do noise-cancelling headphones work?",
    "Suggest a name for a small bakery by the sea.",
    "What is the Pythagorean theorem?",
    "How do bees make honey?",
    "What are the main causes of inflation?",
    "Write a two-line poem about the moon.",
    "Why does ice float on water?",
    "How many continents are there, and which is the largest?",
    "What is machine learning in one paragraph?",
    "How can I politely decline a meeting invitation?",
    "What is the boiling point of water at the top of a high mountain, and why?",
    "Give three ideas for a rainy-day activity with kids.",
    "What is the difference between a virus and a bacterium?",
    "How do I write a good cover letter?",
    "Why do onions make people cry?",
    "What is the speed of light?",
    "Recommend a simple recipe for dinner tonight.",
]

SYSTEM_PROMPT = """You are the support assistant of Northwind Outfitters, an online shop for outdoor clothing
and camping gear. Follow these rules in every answer.
1. Be friendly, concise and concrete. Use at most five sentences unless the customer asks for detail.
2. Orders ship within two business days from our warehouse. Standard delivery takes three to five business
days; express delivery takes one to two business days and costs 9.90 euros. Orders above 80 euros ship free.
3. Customers may return unused items within 30 days of delivery for a full refund. Worn footwear and opened
sleeping pads cannot be returned unless they are defective. Refunds reach the original payment method within
seven days after the return arrives at the warehouse.
4. Every tent, backpack and jacket has a two-year warranty against manufacturing defects. The warranty does
not cover normal wear, accidents or damage from improper use. Ask for the order number and a photo of the
defect.
5. Never promise delivery dates for items marked as pre-order; say that the product page shows the expected
date.
6. Sizes: our jackets run small, so recommend one size up for layering. Boots fit true to size; hiking socks
come in three sizes, S (36-39), M (40-43) and L (44-47).
7. Payments: we accept credit cards, PayPal and bank transfer. Bank transfers delay shipping until the payment
arrives, usually one to two business days.
8. Loyalty program: members collect one point per euro spent; 100 points give a 5 euro voucher. Points expire
after two years. Vouchers cannot be combined with other discount codes.
9. Never ask for a full credit card number, a password or a security code. If the customer shares one, tell
them to remove it and to contact their bank if they are worried.
10. If a question is outside these rules, say that a human colleague will answer by email within one business
day, and ask for the customer's order number or email address.
11. Do not discuss competitors, politics or medical advice. For injuries in the outdoors, tell the customer to
contact local emergency services.
12. End every answer by asking whether there is anything else you can help with.
Now answer the customer's question below."""

CUSTOMER_QUESTIONS = [
    "Can I return hiking boots I wore once on a trail?",
    "How long does express delivery take to Berlin?",
    "My tent pole snapped after two months. What can I do?",
    "Do I pay shipping for an order of 95 euros?",
    "Which jacket size should I order if I usually wear M?",
    "When will my refund arrive after I send back a sleeping bag?",
    "Can I use my loyalty voucher together with a discount code?",
    "I paid by bank transfer yesterday. Why has my order not shipped?",
    "What sock size fits shoe size 42?",
    "When will the pre-order backpack be delivered?",
    "Is a torn jacket sleeve from a fall covered by the warranty?",
    "How many points do I need for a 10 euro voucher?",
]


def synthetic_prompts(num: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    # log-normal word counts, median e^4.1 ~ 60, clipped to 4..400
    lengths = (min(400, max(4, round(rng.lognormvariate(mu=4.1, sigma=0.8)))) for _ in range(num))
    return [Prompt(" ".join(rng.choices(WORDS, k=n)), chat=False) for n in lengths]


def chat_prompts(num: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt(rng.choice(QUESTIONS), chat=True) for _ in range(num)]


def shared_system_prompts(num: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt(f"{SYSTEM_PROMPT}\n\nCustomer: {rng.choice(CUSTOMER_QUESTIONS)}", chat=True)
            for _ in range(num)]


PROMPT_SETS: dict[str, Callable[[int, int], list[Prompt]]] = {
    "synthetic": synthetic_prompts,
    "chat": chat_prompts,
    "shared-system": shared_system_prompts,
}


def make_prompts(name: str, num: int = 256, seed: int = 0) -> list[Prompt]:
    """`num` prompts of set `name`, the same for the same seed."""
    if name not in PROMPT_SETS:
        raise ValueError(f"unknown prompt set {name!r} (known: {', '.join(PROMPT_SETS)})")
    return PROMPT_SETS[name](num, seed)
