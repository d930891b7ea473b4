"""WebShop product catalogue, goals and search engine (App. B "Environment Details").

The WebShop environment (Yao et al., 2022; princeton-nlp/WebShop, ``web_agent_site``)
needs three things besides the page logic in :mod:`sprpo_lib.agent.envs.webshop`:

* a product catalogue in the schema the original builds in
  ``web_agent_site/engine/engine.py::load_products`` (``Title``, ``Description``,
  ``BulletPoints``, ``pricing``/``Price``, ``options``, ``Attributes``, ...);
* the goals, built like ``web_agent_site/engine/goal.py::get_human_goals`` from the
  per-product human instructions and then shuffled with seed 233 as the original's
  ``SimServer`` does (the paper, App. B: goals 0-499 are the 500 test tasks, the other
  11,587 of the 12,087 human instructions are the RL training pool);
* a BM25 search over the products' text (the original uses a Pyserini/Lucene index
  built by ``search_engine/convert_product_file_format.py``).

Two sources are supported:

* **real data** (:func:`load_webshop_data`): the original files ``items_shuffle.json`` +
  ``items_ins_v2.json`` (or the 1,000-product ``*_1000.json`` pair) and
  ``items_human_ins.json``, from a folder given as ``data_dir`` or by the environment
  variable ``WEBSHOP_DATA``;
* the **offline default** (:func:`generate_catalogue`): a seeded, generated catalogue in
  the same schema (5 categories, 2,000 products by default) with generated
  per-product instructions in the ``items_human_ins.json`` format, so that goals go
  through exactly the same goal builder and shuffle as real data.  It needs no files
  and no network, and takes well under a second to build.

Generated products additionally carry ``noun_tokens``: the nouns of their title, which
the type factor of the reward needs (see :func:`sprpo_lib.agent.envs.webshop.title_nouns`).
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import random
import re
import string
import sys
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

from sprpo_lib.agent.envs.base import DATA_VARS, DataError, resolve_data_dir


def import_without_jax(name: str):
    """Import ``name`` with JAX hidden.  ``bm25s`` imports ``jax`` whenever it is installed
    and runs a top-k on JAX's default device at import, which on a GPU machine initialises
    JAX's backend and preallocates 75% of the card's memory (the first PPO update of the
    ``paper`` profile then ran out of memory).  The search reads bm25s's scores only (its
    top-k is numpy's), so bm25s never needs JAX; an application's own JAX is left as it was."""
    if name in sys.modules:
        return sys.modules[name]
    saved = {k: sys.modules[k] for k in list(sys.modules) if k == "jax" or k.startswith("jax.")}
    for k in saved:
        del sys.modules[k]
    sys.modules["jax"] = None  # type: ignore[assignment]  # "import jax" raises ImportError
    try:
        return importlib.import_module(name)
    finally:
        del sys.modules["jax"]
        sys.modules.update(saved)


bm25s = import_without_jax("bm25s")

DATA_ENV_VAR = DATA_VARS["webshop"]
SEARCH_RETURN_N = 50  # results kept per search (engine.py SEARCH_RETURN_N)
GOAL_SHUFFLE_SEED = 233  # SimServer: random.seed(233); random.shuffle(goals)
PRICE_STEPS = tuple(10.0 * i for i in range(1, 100))  # goal.py PRICE_RANGE
NO_PRICE_LIMIT = 1000000  # price_upper when no price clause is given
BM25_K1, BM25_B = 0.9, 0.4  # Pyserini's BM25 defaults, as used by the original index
DEFAULT_N_PRODUCTS = 2000

# File names of the original data (setup.sh downloads them into WebShop/data/).
HUMAN_INS_FILE = "items_human_ins.json"
_PRODUCT_FILE_PAIRS = (
    ("items_shuffle.json", "items_ins_v2.json"),  # setup.sh -d all
    ("items_shuffle_1000.json", "items_ins_v2_1000.json"),  # setup.sh -d small
)


class WebShopDataError(DataError):
    """Raised when a requested WebShop data folder is missing or incomplete."""


def data_error(data_dir: Path, problem: str) -> WebShopDataError:
    """One clear error: what is missing, the expected layout, how to get it."""
    full, small = _PRODUCT_FILE_PAIRS
    return WebShopDataError(
        f"WebShop data: {problem}.\n"
        f"Expected layout of {data_dir}:\n"
        f"  {full[0]} + {full[1]}   (all 1.18M products; or the 1,000-product pair "
        f"{small[0]} + {small[1]})\n"
        f"  {HUMAN_INS_FILE}   (the 12,087 human instructions)\n"
        "Get them with the WebShop repository's setup script: "
        "git clone https://github.com/princeton-nlp/WebShop && cd WebShop && "
        "./setup.sh -d all   (or -d small); the files land in WebShop/data/.\n"
        f"Then pass data_dir=<that folder> or set {DATA_ENV_VAR}=<that folder>.\n"
        f"Without data_dir and with {DATA_ENV_VAR} unset, the offline generated "
        "catalogue is used, which needs no data."
    )


# ---------------------------------------------------------------------------
# Search engine
# ---------------------------------------------------------------------------


def product_document(product: dict) -> str:
    """Indexed text of a product, as ``convert_product_file_format.py`` builds it:
    title, description, first bullet point and ``name: v1, v2`` option text, lowercased."""
    option_text = ", and ".join(
        f"{name}: {', '.join(values)}" for name, values in product["options"].items()
    )
    bullets = product["BulletPoints"]
    return " ".join(
        [product["Title"], product["Description"], bullets[0] if bullets else "", option_text]
    ).lower()


class BM25Search:
    """BM25 (``bm25s``, Lucene variant, k1=0.9, b=0.4) over product documents.

    Differences from the original Pyserini index, by necessity: tokenisation is
    ``bm25s``'s (words of 2+ characters, English stop words removed) and there is no
    Porter stemming (no stemmer package is assumed).  Ties are broken by catalogue
    order, and documents sharing no term with the query are not returned (Lucene
    returns no hit for them either).
    """

    def __init__(self, documents: Sequence[str], cache_size: int = 4096) -> None:
        self._retriever = bm25s.BM25(k1=BM25_K1, b=BM25_B, method="lucene")
        tokens = bm25s.tokenize(list(documents), stopwords="en", show_progress=False)
        self._retriever.index(tokens, show_progress=False)
        self._n_docs = len(documents)
        self._cache: dict[str, tuple[int, ...]] = {}
        self._cache_size = cache_size

    def search(self, query: str, k: int = SEARCH_RETURN_N) -> tuple[int, ...]:
        """Indices of the top-``k`` documents for ``query``, best first."""
        hit = self._cache.get(query)
        if hit is not None:
            return hit[:k]
        terms = bm25s.tokenize(
            [query], stopwords="en", return_ids=False, show_progress=False
        )[0]
        result: tuple[int, ...] = ()
        if terms and self._n_docs:
            scores = self._retriever.get_scores(terms)
            n = min(SEARCH_RETURN_N, self._n_docs)
            threshold = np.partition(scores, self._n_docs - n)[self._n_docs - n]
            candidates = np.flatnonzero((scores >= threshold) & (scores > 0))
            order = np.argsort(-scores[candidates], kind="stable")
            result = tuple(int(i) for i in candidates[order][:SEARCH_RETURN_N])
        if len(self._cache) >= self._cache_size:
            self._cache.clear()
        self._cache[query] = result
        return result[:k]


# ---------------------------------------------------------------------------
# Catalogue
# ---------------------------------------------------------------------------


@dataclass
class WebShopCatalogue:
    """Products, their sampled prices, the shuffled goals, and the search engine.

    Attributes:
        products: processed products (``load_products`` schema), catalogue order.
        product_prices: asin -> price used by the reward (a range is sampled once,
            like ``generate_product_prices``).
        goals: goals in the original's order *after* the seed-233 shuffle; goals
            ``[:500]`` are the test split, the rest the training pool.
        source: human-readable description of where the data came from.
    """

    products: list[dict]
    product_prices: dict[str, float]
    goals: list[dict]
    source: str
    _by_asin: dict[str, int] = field(init=False, repr=False)
    _engine: BM25Search = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._by_asin = {p["asin"]: i for i, p in enumerate(self.products)}
        self._engine = BM25Search([product_document(p) for p in self.products])

    def product(self, asin: str) -> dict:
        return self.products[self._by_asin[asin]]

    def has_asin(self, asin: str) -> bool:
        return asin in self._by_asin

    def search(self, query: str) -> list[dict]:
        """Top-50 products for a query (``get_top_n_product_from_keywords``)."""
        return [self.products[i] for i in self._engine.search(query)]


def sample_product_prices(products: Iterable[dict], rng: random.Random) -> dict[str, float]:
    """``generate_product_prices``: one price, or uniform in a [low, high] range."""
    prices = {}
    for product in products:
        pricing = product["pricing"]
        if not pricing:
            price = 100.0
        elif len(pricing) == 1:
            price = pricing[0]
        else:
            price = rng.uniform(*pricing[:2])
        prices[product["asin"]] = price
    return prices


def build_human_goals(
    products: Iterable[dict], prices: dict[str, float], rng: random.Random
) -> list[dict]:
    """``get_human_goals``: one goal per human instruction with attributes.

    The price limit is the larger of two values drawn from the four multiples of 10
    just above the product's price (no limit when fewer than two exist); the
    original draws from the unseeded global ``random``, here ``rng`` makes it
    reproducible with the same call sequence.
    """
    goals = []
    for item in products:
        asin = item["asin"]
        for ins in item.get("instructions", ()):
            attributes = ins["instruction_attributes"]
            if len(attributes) == 0:
                continue
            above = [p for p in PRICE_STEPS if p > prices[asin]][:4]
            if len(above) >= 2:
                price_upper = sorted(rng.sample(above, 2))[1]
                price_text = f", and price lower than {price_upper:.2f} dollars"
            else:
                price_upper, price_text = NO_PRICE_LIMIT, ""
            goal = {
                "asin": asin,
                "category": item["category"],
                "query": item["query"],
                "name": item["name"],
                "product_category": item["product_category"],
                "instruction_text": ins["instruction"].strip(".") + price_text,
                "attributes": attributes,
                "price_upper": price_upper,
                "goal_options": ins["instruction_options"],
                "weight": 1,
            }
            if "noun_tokens" in item:
                goal["noun_tokens"] = item["noun_tokens"]
            goals.append(goal)
    return goals


def shuffle_goals(goals: list[dict]) -> list[dict]:
    """The original's fixed goal order: ``random.seed(233); random.shuffle(goals)``."""
    shuffled = list(goals)
    random.Random(GOAL_SHUFFLE_SEED).shuffle(shuffled)
    return shuffled


# ---------------------------------------------------------------------------
# Real data (items_shuffle*.json, items_ins_v2*.json, items_human_ins.json)
# ---------------------------------------------------------------------------


def price_tag(pricing: Sequence[float]) -> str:
    """Displayed price, formatted as ``load_products`` does (``$12.99 to $15.0``)."""
    if len(pricing) == 1:
        return f"${pricing[0]}"
    return f"${pricing[0]} to ${pricing[1]}"


def _parse_pricing(raw: Any) -> list[float]:
    """``"$12.99 - $15.00"`` -> ``[12.99, 15.0]``; missing/unparsable -> ``[100.0]``."""
    if not raw or not isinstance(raw, str):
        return [100.0]
    values = []
    for part in raw.split("$")[1:]:
        digits = re.sub(r"[^\d.]", "", part)
        try:
            values.append(float(Decimal(digits)))
        except InvalidOperation:
            continue
    return values[:2] if values else [100.0]


def process_raw_product(
    raw: dict, attributes: dict, human_instructions: dict
) -> dict:
    """One ``items_shuffle`` record -> the processed schema of ``load_products``."""
    p = dict(raw)
    asin = p["asin"]
    bullets = p.get("small_description") or []
    pricing = _parse_pricing(p.get("pricing"))
    options: dict[str, list[str]] = {}
    option_to_image: dict[str, Any] = {}
    for name, contents in (p.get("customization_options") or {}).items():
        if contents is None:
            continue
        values = []
        for content in contents:
            value = content["value"].strip().replace("/", " | ").lower()
            values.append(value)
            option_to_image[value] = content.get("image")
        options[name.lower()] = values
    images = p.get("images") or [""]
    entry = attributes.get(asin)
    entry = entry if isinstance(entry, dict) else {}
    p.update(
        Title=p["name"],
        Description=p.get("full_description") or "",
        BulletPoints=bullets if isinstance(bullets, list) else [bullets],
        Reviews=[],
        Rating="N.A.",
        pricing=pricing,
        Price=price_tag(pricing),
        options=options,
        option_to_image=option_to_image,
        Attributes=entry["attributes"] if "attributes" in entry else ["DUMMY_ATTR"],
        MainImage=images[0],
        query=p["query"].lower().strip(),
    )
    if asin in human_instructions:
        p["instructions"] = human_instructions[asin]
    return p


def _read_json(path: Path) -> Any:
    """One of the data files, parsed; a truncated or foreign file is a :class:`WebShopDataError`
    naming it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise data_error(path.parent, f"{path} is not a whole JSON file ({type(err).__name__}: "
                                      f"{str(err).splitlines()[0][:120]}); download it again") from None


def load_webshop_data(data_dir: str | os.PathLike, seed: int = 0) -> WebShopCatalogue:
    """Load the original WebShop data files from ``data_dir``.

    Uses ``items_shuffle.json`` + ``items_ins_v2.json`` when present, otherwise the
    ``*_1000.json`` pair, and ``items_human_ins.json`` for the goals.  Products are
    filtered as in ``load_products`` (asin ``"nan"`` or longer than 10 characters,
    duplicates).  ``seed`` seeds the price draws (range prices, price limits) that
    the original takes from the unseeded global ``random``; the goal order is the
    original's seed-233 shuffle regardless of ``seed``.

    Raises:
        WebShopDataError: the folder or one of the files is missing.
    """
    root = Path(data_dir).expanduser()
    if not root.is_dir():
        raise data_error(root, f"data folder {root} does not exist")
    pair = next(
        (p for p in _PRODUCT_FILE_PAIRS if (root / p[0]).is_file() and (root / p[1]).is_file()),
        None,
    )
    if pair is None:
        present = [n for p in _PRODUCT_FILE_PAIRS for n in p if (root / n).is_file()]
        missing = [n for p in _PRODUCT_FILE_PAIRS for n in p if n not in present]
        raise data_error(
            root,
            f"no complete product file pair in {root} (missing: {', '.join(missing)})",
        )
    if not (root / HUMAN_INS_FILE).is_file():
        raise data_error(root, f"{HUMAN_INS_FILE} is missing from {root}")

    raw_products = _read_json(root / pair[0])
    attributes = _read_json(root / pair[1])
    human = _read_json(root / HUMAN_INS_FILE)
    products, seen = [], set()
    for raw in raw_products:
        asin = raw["asin"]
        if asin == "nan" or len(asin) > 10 or asin in seen:
            continue
        seen.add(asin)
        products.append(process_raw_product(raw, attributes, human))
    rng = random.Random(seed)
    prices = sample_product_prices(products, rng)
    for p in products:
        p["price"] = prices[p["asin"]]
    goals = shuffle_goals(build_human_goals(products, prices, rng))
    return WebShopCatalogue(products, prices, goals, source=f"{root} ({pair[0]})")


# ---------------------------------------------------------------------------
# Offline generated catalogue
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _ProductType:
    """A kind of product: one search query per descriptor, shared breadcrumb."""

    category: str
    head: str  # title words, e.g. "Face Serum"
    head_nouns: tuple[str, ...]
    breadcrumb: str  # product_category, levels joined by " › "
    descriptors: tuple[tuple[str, tuple[str, ...]], ...]  # (title words, their nouns)
    attributes: tuple[str, ...]
    options: tuple[tuple[str, tuple[str, ...]], ...]  # (option name, value pool)
    price: tuple[float, float]


def _t(
    category: str,
    head: str,
    head_nouns: str,
    breadcrumb: Sequence[str],
    descriptors: Sequence[tuple[str, str]],
    attributes: Sequence[str],
    options: Sequence[tuple[str, Sequence[str]]],
    price: tuple[float, float],
) -> _ProductType:
    """Compact constructor: noun lists as space-separated strings."""
    return _ProductType(
        category,
        head,
        tuple(head_nouns.split()),
        " › ".join(breadcrumb),
        tuple((d, tuple(n.split())) for d, n in descriptors),
        tuple(attributes),
        tuple((name, tuple(values)) for name, values in options),
        price,
    )


_BEAUTY = ("Beauty & Personal Care",)
_ELEC = ("Electronics",)
_PHONE = ("Cell Phones & Accessories",)
_MEN = ("Clothing, Shoes & Jewelry", "Men")
_WOMEN = ("Clothing, Shoes & Jewelry", "Women")
_FOOD = ("Grocery & Gourmet Food",)
_HOME = ("Home & Kitchen", "Furniture")

_PRODUCT_TYPES: tuple[_ProductType, ...] = (
    # --- beauty -------------------------------------------------------------
    _t("beauty", "Face Serum", "face serum",
       _BEAUTY + ("Skin Care", "Face", "Serums"),
       [("Vitamin C", "vitamin"), ("Hyaluronic Acid", "acid"), ("Retinol", "retinol"),
        ("Niacinamide", "niacinamide"), ("Peptide", "peptide")],
       ["anti aging", "cruelty free", "paraben free", "fragrance free", "dermatologist tested",
        "sensitive skin", "fine lines", "dark spots", "natural ingredients"],
       [("size", ["0.5 fl oz (pack of 1)", "1 fl oz (pack of 1)", "1 fl oz (pack of 2)",
                  "2 fl oz (pack of 1)"])],
       (9, 45)),
    _t("beauty", "Clip In Hair Extensions", "clip hair extensions",
       _BEAUTY + ("Hair Care", "Hair Extensions, Wigs & Accessories", "Extensions"),
       [("Straight", ""), ("Wavy", ""), ("Curly", ""), ("Remy", "remy")],
       ["natural looking", "long lasting", "high quality", "easy to apply", "heat resistant",
        "human hair", "tangle free"],
       [("color", ["natural black", "dark brown", "light brown", "honey blonde", "auburn"]),
        ("size", ["14 inch", "18 inch", "22 inch"])],
       (18, 90)),
    _t("beauty", "Shampoo", "shampoo",
       _BEAUTY + ("Hair Care", "Shampoo & Conditioner", "Shampoos"),
       [("Argan Oil", "argan oil"), ("Tea Tree", "tea tree"), ("Biotin", "biotin"),
        ("Keratin", "keratin"), ("Coconut Milk", "coconut milk")],
       ["sulfate free", "paraben free", "dry hair", "hair growth", "color safe",
        "natural ingredients", "cruelty free", "dandruff control"],
       [("size", ["8 fl oz", "16 fl oz", "33.8 fl oz"]),
        ("scent", ["coconut", "mint", "lavender", "unscented", "eucalyptus"])],
       (6, 32)),
    _t("beauty", "Nail Polish", "nail polish",
       _BEAUTY + ("Foot, Hand & Nail Care", "Nail Art & Polish", "Nail Polish"),
       [("Gel", "gel"), ("Matte", ""), ("Glitter", "glitter"), ("Chrome", "chrome")],
       ["long lasting", "non toxic", "quick dry", "high gloss", "easy to remove",
        "chip resistant"],
       [("color", ["cherry red", "nude pink", "navy blue", "glitter silver", "jet black",
                   "coral"]),
        ("size", ["0.5 fl oz", "set of 6", "set of 12"])],
       (5, 28)),
    _t("beauty", "Makeup Brush Set", "makeup brush set",
       _BEAUTY + ("Tools & Accessories", "Makeup Brushes & Tools", "Brush Sets"),
       [("Professional", ""), ("Kabuki", "kabuki"), ("Travel", "travel"),
        ("Foundation", "foundation")],
       ["synthetic bristles", "easy to clean", "travel size", "cruelty free", "high quality",
        "storage case"],
       [("color", ["rose gold", "black", "pink", "white", "champagne"]),
        ("size", ["10 pieces", "14 pieces", "18 pieces"])],
       (8, 40)),
    _t("beauty", "Deodorant", "deodorant",
       _BEAUTY + ("Personal Care", "Deodorants & Antiperspirants", "Deodorants"),
       [("Natural", ""), ("Clinical Strength", "strength"), ("Charcoal", "charcoal"),
        ("Sport", "sport")],
       ["aluminum free", "long lasting", "sensitive skin", "natural ingredients",
        "cruelty free", "baking soda free"],
       [("scent", ["citrus", "lavender", "unscented", "cedarwood", "vanilla"]),
        ("size", ["2.6 ounce (pack of 1)", "2.6 ounce (pack of 2)", "3 ounce (pack of 1)"])],
       (4, 24)),
    _t("beauty", "Lip Balm", "lip balm",
       _BEAUTY + ("Skin Care", "Lip Care", "Balms & Moisturizers"),
       [("Tinted", ""), ("Shea Butter", "shea butter"), ("Beeswax", "beeswax"),
        ("Overnight", "")],
       ["moisturizing", "sun protection", "natural ingredients", "cruelty free",
        "chapped lips", "long lasting"],
       [("flavor", ["peppermint", "strawberry", "honey", "unflavored"]),
        ("size", ["pack of 3", "pack of 6", "pack of 12"])],
       (3, 18)),
    # --- electronics --------------------------------------------------------
    _t("electronics", "Wireless Earbuds", "earbuds",
       _ELEC + ("Headphones, Earbuds & Accessories", "Headphones & Earbuds",
                "Earbud Headphones"),
       [("Bluetooth 5.3", "bluetooth"), ("Sport", "sport"), ("True Wireless", ""),
        ("Noise Cancelling", "noise")],
       ["noise cancelling", "long battery life", "water resistant", "fast charging",
        "hands free", "built in microphone", "touch control"],
       [("color", ["black", "white", "navy blue", "pink", "sage green"])],
       (15, 120)),
    _t("electronics", "Phone Case", "phone case",
       _PHONE + ("Cases, Holsters & Sleeves", "Basic Cases"),
       [("Clear", ""), ("Leather", "leather"), ("Rugged", ""), ("Silicone", "silicone"),
        ("Wallet", "wallet")],
       ["shockproof", "slim fit", "wireless charging", "easy install", "scratch resistant",
        "raised edges"],
       [("color", ["black", "clear", "purple", "midnight green", "red"]),
        ("size", ["iphone 14", "iphone 14 pro", "iphone 15", "galaxy s23"])],
       (6, 35)),
    _t("electronics", "USB C Charger", "usb charger",
       _ELEC + ("Computers & Accessories", "Computer Accessories & Peripherals",
                "Chargers & Adapters"),
       [("GaN", "gan"), ("Dual Port", "port"), ("Foldable", ""), ("Wall", "wall")],
       ["fast charging", "compact design", "overheat protection", "foldable plug",
        "universal compatibility"],
       [("color", ["white", "black"]), ("size", ["20w", "30w", "45w", "65w"])],
       (9, 55)),
    _t("electronics", "HDMI Cable", "hdmi cable",
       _ELEC + ("Television & Video", "Accessories", "Cables", "HDMI Cables"),
       [("8K", ""), ("4K", ""), ("Braided", ""), ("Right Angle", "angle")],
       ["high speed", "gold plated", "braided cord", "ethernet support", "dolby vision"],
       [("size", ["3 feet", "6 feet", "10 feet", "15 feet"]),
        ("style", ["1 pack", "2 pack", "3 pack"])],
       (5, 30)),
    _t("electronics", "Bluetooth Speaker", "bluetooth speaker",
       _ELEC + ("Portable Audio & Video", "Portable Speakers & Docks",
                "Portable Bluetooth Speakers"),
       [("Portable", ""), ("Waterproof", ""), ("Outdoor", ""), ("Mini", "")],
       ["water resistant", "long battery life", "stereo sound", "built in microphone",
        "deep bass", "easy carry"],
       [("color", ["black", "blue", "red", "gray", "teal"])],
       (20, 150)),
    _t("electronics", "TV Wall Mount", "tv wall mount",
       _ELEC + ("Television & Video", "Accessories", "TV Mounts, Stands & Turntables",
                "TV Wall & Ceiling Mounts"),
       [("Full Motion", "motion"), ("Tilting", ""), ("Fixed", ""), ("Corner", "corner")],
       ["easy install", "heavy duty", "cable management", "stainless steel",
        "swivel and tilt"],
       [("size", ["32-55 inch", "42-70 inch", "50-85 inch"])],
       (18, 95)),
    _t("electronics", "Power Bank", "power bank",
       _PHONE + ("Chargers & Power Adapters", "Portable Power Banks"),
       [("Slim", ""), ("Solar", "solar"), ("Magnetic", ""), ("High Capacity", "capacity")],
       ["fast charging", "high capacity", "compact design", "led display",
        "multiple devices"],
       [("color", ["black", "white", "blue"]), ("size", ["10000mah", "20000mah", "30000mah"])],
       (15, 70)),
    # --- fashion ------------------------------------------------------------
    _t("fashion", "Crew Neck Tee", "crew neck tee",
       _MEN + ("Clothing", "Shirts", "T-Shirts"),
       [("Cotton", "cotton"), ("Performance", "performance"), ("Heavyweight", ""),
        ("Pocket", "pocket"), ("Graphic", "")],
       ["machine wash", "short sleeve", "classic fit", "cotton spandex", "soft material",
        "relaxed fit", "tagless collar"],
       [("color", ["heather gray", "black", "white", "navy", "olive green", "maroon"]),
        ("size", ["small", "medium", "large", "x-large", "xx-large"])],
       (8, 30)),
    _t("fashion", "Summer Dress", "summer dress",
       _WOMEN + ("Clothing", "Dresses", "Casual"),
       [("Floral", ""), ("Maxi", "maxi"), ("Wrap", "wrap"), ("Boho", "boho"),
        ("Midi", "midi")],
       ["machine wash", "hand wash", "short sleeve", "long sleeve", "polyester spandex",
        "elastic waist", "v neck"],
       [("color", ["floral blue", "black", "wine red", "khaki", "white", "yellow"]),
        ("size", ["small", "medium", "large", "x-large"])],
       (16, 60)),
    _t("fashion", "Running Shoes", "running shoes",
       _MEN + ("Shoes", "Athletic", "Running", "Road Running"),
       [("Lightweight", ""), ("Trail", "trail"), ("Cushioned", ""), ("Wide", "")],
       ["non slip", "rubber sole", "lace up", "breathable mesh", "arch support",
        "memory foam"],
       [("color", ["black white", "grey", "navy", "red", "all black"]),
        ("size", ["7", "8", "8.5", "9", "10", "11", "12"])],
       (30, 120)),
    _t("fashion", "Athletic Socks", "athletic socks",
       _MEN + ("Clothing", "Socks", "Athletic Socks"),
       [("Ankle", "ankle"), ("Crew", "crew"), ("No Show", "show"), ("Compression", "compression")],
       ["moisture wicking", "cushioned sole", "machine wash", "arch support",
        "breathable cotton"],
       [("color", ["white", "black", "gray", "assorted"]),
        ("size", ["medium", "large", "x-large"])],
       (7, 25)),
    _t("fashion", "Baseball Cap", "baseball cap",
       _MEN + ("Accessories", "Hats & Caps", "Baseball Caps"),
       [("Classic", ""), ("Trucker", "trucker"), ("Distressed", ""), ("Dad Hat", "dad hat")],
       ["adjustable strap", "cotton twill", "sun protection", "one size fits most",
        "curved brim"],
       [("color", ["black", "khaki", "navy", "olive", "pink", "white"])],
       (6, 28)),
    _t("fashion", "Yoga Leggings", "yoga leggings",
       _WOMEN + ("Clothing", "Active", "Active Leggings"),
       [("High Waisted", ""), ("Capri", "capri"), ("Pocket", "pocket"), ("Seamless", "")],
       ["high waist", "tummy control", "squat proof", "moisture wicking",
        "four way stretch", "hidden pocket"],
       [("color", ["black", "charcoal", "navy", "burgundy", "dusty rose"]),
        ("size", ["x-small", "small", "medium", "large", "x-large"])],
       (12, 45)),
    _t("fashion", "Puffer Jacket", "puffer jacket",
       _MEN + ("Clothing", "Jackets & Coats", "Down & Down Alternative"),
       [("Hooded", ""), ("Packable", ""), ("Winter", "winter"), ("Quilted", "")],
       ["water resistant", "zipper closure", "lightweight warmth", "machine wash",
        "windproof shell", "detachable hood"],
       [("color", ["black", "army green", "navy", "camel", "gray"]),
        ("size", ["small", "medium", "large", "x-large", "xx-large"])],
       (35, 140)),
    # --- food ---------------------------------------------------------------
    _t("food", "Protein Bars", "protein bars",
       ("Health & Household", "Diet & Sports Nutrition", "Nutrition Bars", "Protein Bars"),
       [("Whey", "whey"), ("Vegan", ""), ("Keto", "keto"), ("Crispy", "")],
       ["gluten free", "low sugar", "high protein", "non gmo", "keto friendly",
        "plant based"],
       [("flavor", ["chocolate chip", "peanut butter", "cookie dough", "salted caramel",
                    "birthday cake"]),
        ("size", ["12 count (pack of 1)", "12 count (pack of 2)", "24 count"])],
       (14, 48)),
    _t("food", "Ground Coffee", "coffee",
       _FOOD + ("Beverages", "Coffee, Tea & Cocoa", "Coffee", "Ground Coffee"),
       [("Colombian", ""), ("Espresso", "espresso"), ("Breakfast Blend", "breakfast blend"),
        ("Decaf", "decaf")],
       ["medium roast", "dark roast", "fair trade", "usda organic", "kosher certified",
        "smooth finish"],
       [("size", ["12 ounce (pack of 1)", "12 ounce (pack of 3)", "2 pound"]),
        ("flavor", ["original", "french vanilla", "hazelnut", "mocha"])],
       (8, 40)),
    _t("food", "Herbal Tea Bags", "tea bags",
       _FOOD + ("Beverages", "Coffee, Tea & Cocoa", "Tea", "Herbal"),
       [("Organic", ""), ("Sleep", "sleep"), ("Detox", "detox"), ("Immune", "")],
       ["caffeine free", "usda organic", "non gmo", "gluten free", "individually wrapped"],
       [("flavor", ["chamomile", "peppermint", "ginger", "lemon", "hibiscus"]),
        ("size", ["20 count", "40 count", "100 count"])],
       (5, 25)),
    _t("food", "Extra Virgin Olive Oil", "olive oil",
       _FOOD + ("Pantry Staples", "Cooking & Baking", "Oils, Vinegars & Salad Dressings",
                "Oils", "Olive"),
       [("Italian", ""), ("Greek", ""), ("Spanish", ""), ("California", "california")],
       ["cold pressed", "non gmo", "kosher certified", "usda organic", "single origin"],
       [("size", ["16.9 fl oz", "33.8 fl oz", "1 gallon"])],
       (9, 55)),
    _t("food", "Mixed Nuts", "nuts",
       _FOOD + ("Snacks & Sweets", "Nuts & Seeds", "Mixed Nuts"),
       [("Deluxe", ""), ("Roasted", ""), ("Trail Mix", "trail mix"), ("Cashew", "cashew")],
       ["low sodium", "non gmo", "resealable bag", "high protein", "no artificial flavors"],
       [("flavor", ["sea salt", "unsalted", "honey roasted", "smoked"]),
        ("size", ["1 pound", "2 pound", "40 ounce"])],
       (8, 36)),
    _t("food", "Gummy Candy", "gummy candy",
       _FOOD + ("Snacks & Sweets", "Candy & Chocolate", "Gummy Candy"),
       [("Sour", ""), ("Fruit", "fruit"), ("Vegan", ""), ("Bears", "bears")],
       ["gluten free", "fat free", "individually wrapped", "natural flavors",
        "gelatin free"],
       [("flavor", ["assorted fruit", "sour apple", "cherry", "watermelon"]),
        ("size", ["5 ounce (pack of 6)", "2 pound bag", "4 pound bag"])],
       (5, 30)),
    # --- furniture ----------------------------------------------------------
    _t("furniture", "Office Chair", "office chair",
       _HOME + ("Home Office Furniture", "Home Office Chairs", "Desk Chairs"),
       [("Ergonomic", ""), ("Mesh", "mesh"), ("Executive", ""), ("Gaming", "gaming")],
       ["lumbar support", "adjustable height", "easy assemble", "high back", "heavy duty",
        "padded armrests"],
       [("color", ["black", "gray", "white", "blue"]),
        ("style", ["with armrest", "without armrest", "with footrest"])],
       (60, 300)),
    _t("furniture", "Bookshelf", "bookshelf",
       _HOME + ("Home Office Furniture", "Bookcases"),
       [("Industrial", ""), ("Ladder", "ladder"), ("Corner", "corner"), ("Cube", "cube")],
       ["easy assemble", "storage space", "engineered wood", "anti tip", "metal frame"],
       [("color", ["white", "espresso", "rustic brown", "black"]),
        ("size", ["3 tier", "4 tier", "5 tier"])],
       (35, 180)),
    _t("furniture", "Coffee Table", "coffee table",
       _HOME + ("Living Room Furniture", "Tables", "Coffee Tables"),
       [("Lift Top", "top"), ("Round", ""), ("Farmhouse", "farmhouse"), ("Glass", "glass")],
       ["living room", "easy assemble", "solid wood", "storage shelf", "metal frame"],
       [("color", ["walnut", "rustic oak", "black", "white"])],
       (50, 260)),
    _t("furniture", "Bed Frame", "bed frame",
       _HOME + ("Bedroom Furniture", "Beds, Frames & Bases", "Bed Frames"),
       [("Metal Platform", "metal platform"), ("Upholstered", ""), ("Wooden", ""),
        ("Canopy", "canopy")],
       ["easy assemble", "heavy duty", "noise free", "no box spring needed",
        "under bed storage"],
       [("size", ["twin", "full", "queen", "king"])],
       (70, 400)),
    _t("furniture", "Bar Stools", "bar stools",
       _HOME + ("Game & Recreation Room Furniture", "Home Bar Furniture", "Barstools"),
       [("Swivel", ""), ("Counter Height", "counter height"), ("Backless", ""),
        ("Farmhouse", "farmhouse")],
       ["adjustable height", "faux leather", "easy assemble", "footrest ring",
        "swivel seat"],
       [("color", ["black", "brown", "gray", "white"]),
        ("size", ["24 inch", "26 inch", "30 inch"])],
       (45, 220)),
    _t("furniture", "Shoe Rack", "shoe rack",
       ("Home & Kitchen", "Storage & Organization", "Clothing & Closet Storage",
        "Shoe Organizers", "Free Standing Shoe Racks"),
       [("Stackable", ""), ("Bamboo", "bamboo"), ("Entryway", "entryway"), ("Metal", "metal")],
       ["space saving", "easy assemble", "stainless steel", "entryway bench",
        "waterproof fabric"],
       [("color", ["black", "white", "natural", "gray"]),
        ("size", ["3 tier", "4 tier", "6 tier"])],
       (15, 80)),
    _t("furniture", "Floor Lamp", "floor lamp",
       _HOME + ("Living Room Furniture", "Lighting", "Floor Lamps"),
       [("Arc", "arc"), ("Tripod", "tripod"), ("Torchiere", "torchiere"), ("LED", "led")],
       ["living room", "dimmable light", "foot switch", "energy efficient",
        "easy assemble"],
       [("color", ["black", "gold", "white", "bronze"])],
       (30, 160)),
)

_BRANDS = {
    "beauty": ("Lumora", "Velisse", "Petalune", "Aurelle", "Glowen", "Serafina", "Mirabel",
               "Calyx", "Bloomere", "Nuvie", "Oriska", "Silkara"),
    "electronics": ("Voltra", "Zentek", "Aeroplex", "Nexora", "Sonique", "Quantix",
                    "Pulsaro", "Ampero", "Kinetix", "Lumentra", "Orbix", "Trivox"),
    "fashion": ("Northvale", "Urbanite", "Cordell", "Marlow", "Kestrel", "Halden",
                "Tessaro", "Brindle", "Ashford", "Verano", "Evander", "Juniper"),
    "food": ("Harvestly", "Grainwell", "Orchardia", "Nutrivo", "Farmhouse", "Sprouta",
             "Bellacasa", "Tastera", "Wholesome", "Meadowly", "Pantrio", "Crestfield"),
    "furniture": ("Oakhaven", "Hearthwood", "Loftline", "Nordhem", "Casabella", "Woodora",
                  "Vintora", "Homestead", "Arbory", "Modulo", "Timberly", "Sofino"),
}

_DESCRIPTION_TEMPLATES = (
    "The {brand} {thing} is made for everyday use. {feature_sentence}",
    "Meet the {thing} from {brand}. {feature_sentence} Backed by our customer promise.",
    "{brand} designed this {thing} with care. {feature_sentence}",
)
_FEATURE_SENTENCES = (
    "It stands out for being {attrs}.",
    "Customers choose it because it is {attrs}.",
    "Key qualities: {attrs}.",
)
_BULLET_TEMPLATES = (
    "{Attr}: carefully tested so you can rely on it",
    "{Attr} - a favorite feature among our customers",
    "{Attr} for everyday confidence",
)
_GENERIC_BULLETS = (
    "Satisfaction promise: contact us with any question and we will help",
    "Ships in protective packaging",
    "Designed and inspected by our in-house team",
)
_REVIEW_TITLES = ("Great value", "Just as described", "Would buy again", "Not bad",
                  "Exceeded expectations", "Decent for the price")
_REVIEW_BODIES = ("Works as expected and arrived on time.", "Quality is good for the price.",
                  "My second order of this item.", "Does the job, nothing fancy.")
_INSTRUCTION_TEMPLATES = (
    "i am looking for {thing} that is {attrs}{opts}",
    "i need a {attrs} {thing}{opts}",
    "find me {thing}, {attrs}{opts}",
    "i want to buy {thing} which is {attrs}{opts}",
)
_OPTION_PHRASES = {
    "color": "{v} color",
    "size": "size {v}",
    "flavor": "{v} flavor",
    "scent": "{v} scent",
    "style": "{v} style",
}


def _join_words(words: Sequence[str]) -> str:
    """``["a"]`` -> "a"; ``["a", "b", "c"]`` -> "a, b and c"."""
    if len(words) == 1:
        return words[0]
    return ", ".join(words[:-1]) + " and " + words[-1]


def _new_asin(rng: random.Random, taken: set[str]) -> str:
    alphabet = string.ascii_uppercase + string.digits
    while True:
        asin = "B0" + "".join(rng.choice(alphabet) for _ in range(8))
        if asin not in taken:
            taken.add(asin)
            return asin


def _generate_instructions(
    rng: random.Random,
    asin: str,
    thing: str,
    attrs: list[str],
    options: dict[str, list[str]],
    texts: set[str],
) -> list[dict]:
    """1-3 instructions in the ``items_human_ins.json`` record format.

    ``texts`` holds the instructions generated so far (catalogue-wide); a repeated
    text is dropped so that no two goals share an instruction."""
    records = []
    for _ in range(rng.choice((1, 2, 2, 3))):
        chosen = rng.sample(attrs, rng.randint(1, min(3, len(attrs))))
        picked = [(n, rng.choice(vs)) for n, vs in options.items() if rng.random() < 0.8]
        parts = [_OPTION_PHRASES.get(n, n + " {v}").format(v=v) for n, v in picked]
        text = rng.choice(_INSTRUCTION_TEMPLATES).format(
            thing=thing,
            attrs=_join_words(chosen),
            opts=(", in " + " and ".join(parts)) if parts else "",
        )
        if text in texts:
            continue
        texts.add(text)
        records.append({
            "asin": asin,
            "instruction": text,
            "instruction_attributes": chosen,
            "instruction_options": [v for _, v in picked],
        })
    return records


def _generate_product(
    rng: random.Random, ptype: _ProductType, asin: str, texts: set[str]
) -> dict:
    brand = rng.choice(_BRANDS[ptype.category])
    label, label_nouns = rng.choice(ptype.descriptors)
    query = f"{label} {ptype.head}".lower()
    attrs = rng.sample(ptype.attributes, rng.randint(3, min(5, len(ptype.attributes))))
    title = f"{brand} {label} {ptype.head}"
    if rng.random() < 0.6:
        title += " - " + ", ".join(a.title() for a in attrs[: rng.randint(1, 2)])
    options = {}
    for name, pool in ptype.options:
        if rng.random() < 0.85:
            keep = set(rng.sample(range(len(pool)), rng.randint(2, len(pool))))
            options[name] = [v for i, v in enumerate(pool) if i in keep]
    low, high = ptype.price
    price = max(0.99, round(rng.uniform(low, high)) - 0.01)
    if rng.random() < 0.2:
        pricing = [price, round(price + rng.uniform(2.0, (high - low) / 2), 2)]
    else:
        pricing = [price]
    thing = ptype.head.lower()
    description = rng.choice(_DESCRIPTION_TEMPLATES).format(
        brand=brand,
        thing=thing,
        feature_sentence=rng.choice(_FEATURE_SENTENCES).format(
            attrs=_join_words(attrs[: rng.randint(1, 3)])
        ),
    )
    bullets = [rng.choice(_BULLET_TEMPLATES).format(Attr=a.capitalize()) for a in attrs]
    bullets += rng.sample(_GENERIC_BULLETS, rng.randint(1, 2))
    reviews = [
        {
            "title": rng.choice(_REVIEW_TITLES),
            "score": rng.randint(2, 5),
            "body": rng.choice(_REVIEW_BODIES),
        }
        for _ in range(rng.randint(0, 3))
    ]
    rating = (
        f"{sum(r['score'] for r in reviews) / len(reviews):.1f}" if reviews else "N.A."
    )
    spoken = f"{label} {thing}".lower() if rng.random() < 0.5 else thing
    return {
        "asin": asin,
        "name": title,
        "Title": title,
        "category": ptype.category,
        "query": query,
        "product_category": ptype.breadcrumb,
        "full_description": description,
        "Description": description,
        "small_description": bullets,
        "BulletPoints": bullets,
        "pricing": pricing,
        "Price": price_tag(pricing),
        "options": options,
        "option_to_image": {v: None for vs in options.values() for v in vs},
        "Attributes": attrs,
        "Reviews": reviews,
        "Rating": rating,
        "MainImage": "",
        "images": [""],
        "noun_tokens": [brand.lower(), *label_nouns, *ptype.head_nouns],
        "instructions": _generate_instructions(rng, asin, spoken, attrs, options, texts),
    }


def generate_catalogue(seed: int = 0, n_products: int = DEFAULT_N_PRODUCTS) -> WebShopCatalogue:
    """A seeded synthetic catalogue in the original schema, with goals.

    Products are drawn from 34 product types in the original's 5 categories
    (beauty, electronics, fashion, food, furniture); every product has a search
    ``query`` shared with its siblings (type + descriptor), a ``product_category``
    breadcrumb, 3-5 attributes, 0-2 option groups, a price or price range,
    description, bullet points, reviews and 1-3 instructions.  Goals are then built
    and shuffled exactly as for real data.  Deterministic in ``(seed, n_products)``.
    """
    if n_products < 1:
        raise ValueError(f"n_products must be positive, got {n_products}")
    rng = random.Random(seed)
    taken: set[str] = set()
    texts: set[str] = set()
    products = [
        _generate_product(
            rng, _PRODUCT_TYPES[i % len(_PRODUCT_TYPES)], _new_asin(rng, taken), texts
        )
        for i in rng.sample(range(n_products), n_products)
    ]
    prices = sample_product_prices(products, rng)
    for p in products:
        p["price"] = prices[p["asin"]]
    goals = shuffle_goals(build_human_goals(products, prices, rng))
    return WebShopCatalogue(
        products, prices, goals, source=f"generated(seed={seed}, n_products={n_products})"
    )


@functools.lru_cache(maxsize=4)
def _cached_catalogue(data_dir: str | None, seed: int, n_products: int) -> WebShopCatalogue:
    if data_dir is None:
        return generate_catalogue(seed, n_products)
    return load_webshop_data(data_dir, seed)


def get_catalogue(
    data_dir: str | os.PathLike | None = None,
    seed: int = 0,
    n_products: int = DEFAULT_N_PRODUCTS,
) -> WebShopCatalogue:
    """Real data from ``data_dir``, else ``$WEBSHOP_DATA``, else the generated default
    (:func:`~sprpo_lib.agent.envs.base.resolve_data_dir`, the rule of both environments).

    Results are cached in memory per ``(data folder, seed, n_products)``; callers must
    not mutate the returned catalogue.
    """
    folder, where = resolve_data_dir("webshop", data_dir)
    if folder is None:
        return _cached_catalogue(None, seed, n_products)
    try:
        return _cached_catalogue(str(folder), seed, 0)
    except WebShopDataError as err:  # the error names where the folder came from
        raise WebShopDataError(f"{where}: {err}") from None
