"""WebShop text environment (App. B "Environment Details"), re-implemented offline.

Behaviour follows the text mode of the original WebShop (Yao et al., 2022;
princeton-nlp/WebShop, ``web_agent_site/envs/web_agent_text_env.py`` with the page
templates used by GiGPO's verl-agent copy):

* actions ``search[query]`` and ``click[button]`` (parsed like ``engine.parse_action``:
  regex ``(.+)\\[(.+)\\]``, argument lowercased; a search is accepted on any page, a
  click only on one of the current page's clickables);
* pages: search page -> results (10 per page of the top-50 BM25 hits, ``Next >`` /
  ``< Prev``, ``Back to Search``) -> item page (option values to click, ``Description``
  / ``Features`` / ``Reviews`` sub-pages with ``< Prev`` back, ``Buy Now``);
* observation: the page's visible text pieces joined with `` [SEP] ``;
* admissible actions: ``get_available_actions`` (search bar + clickables, buttons and
  product links lowercased, option values verbatim), rendered as
  ``search[<your query>]`` on the search page plus ``click[<clickable>]``;
* reward on ``Buy Now``: ``goal.py::get_reward`` (attributes, options, price, type
  factor) re-implemented below; ``success`` means reward == 1.0;
* episodes end on purchase or after 15 steps (App. B).

Invalid or malformed actions are ordinary steps: the page is unchanged (the same
observation text), no reward; ``info["invalid"]`` flags them.

Choices where the original is ambiguous or not reproducible here are listed in the
docstrings of :class:`WebShopEpisode` and :func:`title_nouns`.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from rapidfuzz import fuzz
from rapidfuzz.utils import default_process

from sprpo_lib.agent.envs.base import GENERATED, Observation, check_split, data_source
from sprpo_lib.agent.envs.webshop_catalog import DEFAULT_N_PRODUCTS, WebShopCatalogue, WebShopDataError, get_catalogue

__all__ = [
    "MAX_STEPS",
    "N_TEST_GOALS",
    "SEARCH_PLACEHOLDER",
    "WebShopDataError",
    "WebShopEpisode",
    "WebShopPool",
    "WebShopTask",
    "fuzzy_match_score",
    "get_reward",
    "make_webshop_pool",
    "normalize_color",
    "shopper_query",
    "title_nouns",
    "visible_shopper_action",
]

MAX_STEPS = 15  # App. B: WebShop episodes last at most 15 environment steps
N_TEST_GOALS = 500  # App. B: goals 0-499 (after the seed-233 shuffle) are the test set
PRODUCT_WINDOW = 10  # results per page (engine.py PRODUCT_WINDOW)
SEARCH_PLACEHOLDER = "search[<your query>]"  # admissible entry for the search bar
FUZZY_THRESHOLD = 85  # goal.py: a fuzzy match needs token_set_ratio > 85

# Buttons (lowercase clickable text, as get_available_actions keys them).
BACK_TO_SEARCH = "back to search"
PREV_PAGE = "< prev"
NEXT_PAGE = "next >"
BUY_NOW = "buy now"
SUB_PAGES = ("description", "features", "reviews")

# Page names (as SimServer.get_page_name distinguishes them).
SEARCH, RESULTS, ITEM, ITEM_SUB, DONE = "search", "results", "item", "item_sub", "done"

# ---------------------------------------------------------------------------
# Reward (WebShop web_agent_site/engine/goal.py get_reward and helpers)
# ---------------------------------------------------------------------------

# Colour vocabulary of web_agent_site/engine/normalize.py; order matters (first hit wins).
_COLOR_WORDS = tuple(
    """alabaster apricot aqua ash asphalt azure banana beige black blue blush bordeaux
    bronze brown burgundy camel camo caramel champagne charcoal cheetah chestnut chocolate
    christmas coffee cognac copper coral cranberry cream crystal dark denim eggplant
    elephant espresso fuchsia gold granite grape graphite grass gray green grey heather
    indigo ivory ivy khaki lavender lemon leopard light lilac lime magenta maroon mauve
    merlot midnight mint mocha multicolor mushroom mustard natural navy nude olive orange
    peach pewter pink plum purple rainbow red rose royal rust sand sapphire seashell
    silver skull slate steel stone stonewash sunflower tan taupe teal tiger turquoise
    violet walnut wheat white wine yellow""".split()
)

# English function words dropped by the no-spaCy noun heuristic of title_nouns().
_FUNCTION_WORDS = frozenset(
    """a an the and or but nor of for to in on at by with without from into onto over
    under up down off out as is are be it its this that these those than then so such
    no not all any each both per via vs plus new""".split()
)


def normalize_color(value: str) -> str:
    """``normalize.py::normalize_color``: the first colour word contained in ``value``
    (substring test, vocabulary order), else ``value`` unchanged."""
    for color in _COLOR_WORDS:
        if color in value:
            return color
    return value


def fuzzy_match_score(a: str, b: str) -> int:
    """``thefuzz.fuzz.token_set_ratio`` (the original's scorer) via ``rapidfuzz``.

    thefuzz removes characters 128-255 (``force_ascii``), applies rapidfuzz's
    ``default_process`` (lowercase, non-alphanumerics -> spaces, trim) and rounds the
    score to an integer; the same steps are applied here.
    """
    a = "".join(c for c in a if not 128 <= ord(c) <= 255)
    b = "".join(c for c in b if not 128 <= ord(c) <= 255)
    return int(round(fuzz.token_set_ratio(a, b, processor=default_process)))


@functools.lru_cache(maxsize=1)
def spacy_pipeline() -> Callable | None:
    """spaCy's ``en_core_web_sm`` if both spaCy and the model are installed, else None."""
    try:
        import spacy  # optional (real WebShop search): loaded on use

        return spacy.load("en_core_web_sm")
    except (ImportError, OSError):
        return None


@functools.lru_cache(maxsize=65536)
def _nouns_of_name(name: str) -> tuple[str, ...]:
    nlp = spacy_pipeline()
    if nlp is not None:
        return tuple(t.text.lower() for t in nlp(name) if t.pos_ in ("NOUN", "PROPN"))
    return tuple(
        w for w in re.findall(r"[a-z]+", name.lower()) if len(w) > 1 and w not in _FUNCTION_WORDS
    )


def title_nouns(record: Mapping) -> list[str]:
    """Nouns of a product's / goal's ``name``, for the type factor of the reward.

    The original tags the name with spaCy (``en_core_web_sm``) and keeps tokens tagged
    NOUN or PROPN, lowercased (duplicates kept).  That model is not available offline,
    so, in this order:

    1. a stored list ``record["noun_tokens"]`` when present (the generated catalogue
       stores the nouns of every title, and real data may be pre-tagged this way);
    2. spaCy with ``en_core_web_sm`` when both are installed (the original's method);
    3. otherwise a heuristic: the lowercase alphabetic words of the name (length >= 2)
       minus English function words.  It keeps adjectives too, so its title scores
       are lower than spaCy's for partially matching names.
    """
    stored = record.get("noun_tokens")
    if stored is not None:
        return list(stored)
    return list(_nouns_of_name(record["name"]))


def _type_reward(product: Mapping, goal: Mapping) -> dict:
    """``get_type_reward``: 1, 0.5, 0.1 or 0 depending on how well the product type fits."""
    query_match = product["query"] == goal["query"]
    levels_p = {x.strip() for x in product["product_category"].split("›")}
    levels_g = {x.strip() for x in goal["product_category"].split("›")}
    category_match = len(levels_p & levels_g) >= 2
    bought, wanted = title_nouns(product), title_nouns(goal)
    title_score = len(set(bought) & set(wanted)) / len(wanted) if wanted else 0.2
    r_type = 1.0
    if not (query_match or category_match or title_score > 0.2):
        r_type = 0.5
    if title_score < 0.1:
        r_type = 0.1
    if title_score == 0.0:
        r_type = 0.0
    return {
        "r_type": r_type,
        "query_match": query_match,
        "category_match": category_match,
        "title_score": title_score,
    }


def _attribute_matches(product: Mapping, goal_attributes: Sequence[str]) -> int:
    """``get_attribute_reward``: goal attributes fuzzily in the product's attributes,
    or else contained in its title, bullet points or description (lowercased)."""
    title = product["Title"].lower()
    bullets = " ".join(product["BulletPoints"]).lower()
    description = product["Description"].lower()
    matches = 0
    for wanted in goal_attributes:
        if any(fuzzy_match_score(have, wanted) > FUZZY_THRESHOLD for have in product["Attributes"]):
            matches += 1
        elif wanted in title or wanted in bullets or wanted in description:
            matches += 1
    return matches


def _option_matches(chosen: Sequence[str], goal_options: Sequence[str]) -> int:
    """``get_option_reward``: goal options fuzzily matched by a chosen option value,
    both colour-normalised first."""
    chosen_n = [normalize_color(o) for o in chosen]
    matches = 0
    for wanted in (normalize_color(o) for o in goal_options):
        if any(fuzzy_match_score(have, wanted) > FUZZY_THRESHOLD for have in chosen_n):
            matches += 1
    return matches


def goal_option_values(goal: Mapping) -> list[str]:
    """Goal options as a list of values (human goals: a list; dict goals: its values)."""
    options = goal["goal_options"]
    return list(options.values()) if isinstance(options, Mapping) else list(options)


def get_reward(
    product: Mapping, goal: Mapping, price: float, options: Mapping[str, str]
) -> tuple[float, dict]:
    """Score of buying ``product`` at ``price`` with the chosen ``options`` for ``goal``.

    WebShop ``goal.py::get_reward``:
    ``r_type * (n_attr_matched + n_opt_matched + [price <= price_upper])
    / (n_goal_attr + n_goal_opt + 1)``.
    Dict-valued goal options are compared by their values (human goals store a list).
    Returns the score and the sub-scores (``verbose=True`` info of the original).
    """
    type_info = _type_reward(product, goal)
    goal_opts = goal_option_values(goal)
    n_attr = _attribute_matches(product, goal["attributes"])
    n_opt = _option_matches(list(options.values()), goal_opts)
    r_price = float(price <= goal["price_upper"])
    denominator = len(goal["attributes"]) + len(goal_opts) + 1
    reward = (n_attr + n_opt + r_price) / denominator * type_info["r_type"]
    info = dict(type_info)
    info.update(
        r_att=n_attr / len(goal["attributes"]) if goal["attributes"] else 0.0,
        w_att=len(goal["attributes"]) / denominator,
        r_price=r_price,
        w_price=1 / denominator,
    )
    if goal_opts:
        info.update(r_option=n_opt / len(goal_opts), w_option=len(goal_opts) / denominator)
    return reward, info


# ---------------------------------------------------------------------------
# Episode
# ---------------------------------------------------------------------------

_ACTION_RE = re.compile(r"(.+)\[(.+)\]")  # engine.parse_action


def parse_action(action: str) -> tuple[str, str | None]:
    """``engine.parse_action``: ``name[arg]`` -> (name, arg); else (action, None).

    Surrounding whitespace of the whole action is stripped first (model outputs)."""
    match = _ACTION_RE.match(action.strip())
    if match is None:
        return action, None
    return match.group(1), match.group(2)


def _shorten(text: str, limit: int = 80) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class WebShopEpisode:
    """One shopping session for one goal (implements :class:`base.Episode`).

    Choices where the original is ambiguous or cannot be reproduced:

    * text mode layout: the templates of GiGPO's verl-agent copy of WebShop
      (``Instruction:`` and the instruction as two pieces, results header
      ``Page N (Total results: T)``, item page ``Back to Search``/``< Prev``, options,
      title, ``Price:``, ``Rating:``, sub-page and ``Buy Now`` buttons); whitespace-only
      text pieces are dropped;
    * ``Next >`` is shown only while more results remain (princeton-nlp template;
      verl-agent's copy always shows it, leading to empty pages);
    * ``click[search]`` is not listed as admissible: the original's ``step`` rejects it;
      the search page lists only ``search[<your query>]``.  As in the original, a
      ``search[...]`` is executed from any page although only the search page lists it;
    * the done page shows ``Thank you for shopping with us!`` and the score (the
      original's done page also prints hidden goal details, omitted here);
    * an invalid step returns the unchanged page (as the original ``WebAgentTextEnv``),
      so GiGPO's anchor groups are not split by an error text; ``info["invalid"]`` and
      ``info["problem"]`` say why, and the agent's history marks the action invalid.
    """

    def __init__(
        self,
        catalogue: WebShopCatalogue,
        goal: dict,
        max_steps: int = MAX_STEPS,
        expert_query: Callable[[], str] | None = None,
    ) -> None:
        """``expert_query`` gives the oracle's search query (default: the goal's
        ``query``); :class:`WebShopTask` passes its cached, verified choice."""
        self.catalogue = catalogue
        self.goal = goal
        self.instruction: str = goal["instruction_text"]
        self.max_steps = max_steps
        self._expert_query = expert_query or (lambda: goal["query"])
        self._init_state()

    # -- state ---------------------------------------------------------------

    def _init_state(self) -> None:
        self._page = SEARCH
        self._keywords = ""
        self._results: list[dict] = []
        self._page_no = 1
        self._asin: str | None = None
        self._options: dict[str, str] = {}
        self._sub_page: str | None = None
        self._steps = 0
        self._done = False
        self._score = 0.0
        self._reward_info: dict = {}
        self._render()

    def _render(self) -> None:
        """Compute the current page's text pieces and clickables."""
        header = ["Instruction:", self.instruction]
        clickables: dict[str, tuple[str, str]] = {}  # text -> (kind, payload)
        if self._page == SEARCH:
            texts = ["WebShop", *header, "Search"]
        elif self._page == RESULTS:
            total = len(self._results)
            texts = [*header, "Back to Search", f"Page {self._page_no} (Total results: {total})"]
            clickables[BACK_TO_SEARCH] = ("button", BACK_TO_SEARCH)
            if self._page_no > 1:
                texts.append("< Prev")
                clickables[PREV_PAGE] = ("button", PREV_PAGE)
            if self._page_no * PRODUCT_WINDOW < total:
                texts.append("Next >")
                clickables[NEXT_PAGE] = ("button", NEXT_PAGE)
            start = (self._page_no - 1) * PRODUCT_WINDOW
            for product in self._results[start : start + PRODUCT_WINDOW]:
                texts += [product["asin"], product["Title"], product["Price"]]
                clickables[product["asin"].lower()] = ("product", product["asin"])
        elif self._page == ITEM:
            product = self.catalogue.product(self._asin)
            texts = [*header, "Back to Search", "< Prev"]
            for name, values in product["options"].items():
                texts += [name, *values]
            texts += [
                product["Title"], f"Price: {product['Price']}", f"Rating: {product['Rating']}",
                "Description", "Features", "Reviews", "Buy Now",
            ]
            for button in (BACK_TO_SEARCH, PREV_PAGE, *SUB_PAGES, BUY_NOW):
                clickables[button] = ("button", button)
            for name, values in product["options"].items():
                for value in values:  # a value listed twice: the later option wins
                    clickables[value] = ("option", name)
        elif self._page == ITEM_SUB:
            product = self.catalogue.product(self._asin)
            texts = [*header, "Back to Search", "< Prev"]
            if self._sub_page == "description":
                texts.append(product["Description"])
            elif self._sub_page == "features":
                texts += list(product["BulletPoints"])
            else:
                for review in product["Reviews"]:
                    texts += [f"\"{review['title']}\"", str(review["score"]), review["body"]]
            clickables[BACK_TO_SEARCH] = ("button", BACK_TO_SEARCH)
            clickables[PREV_PAGE] = ("button", PREV_PAGE)
        else:
            texts = ["Thank you for shopping with us!", "Your score (min 0.0, max 1.0)",
                     str(self._score)]
        pieces = (t.strip() for t in texts)
        self._text = " [SEP] ".join(t for t in pieces if t)
        self._clickables = clickables

    def admissible_actions(self) -> list[str]:
        """Admissible actions of the current page (``get_available_actions``)."""
        actions = [SEARCH_PLACEHOLDER] if self._page == SEARCH else []
        return actions + [f"click[{c}]" for c in self._clickables]

    def _observation(self, reward: float = 0.0, text: str | None = None, **info) -> Observation:
        info.update(page=self._page, step=self._steps, asin=self._asin,
                    selected_options=dict(self._options))
        if self._done and self._page == DONE:
            info.update(score=self._score, reward_info=self._reward_info)
        return Observation(
            text=self._text if text is None else text,
            admissible=[] if self._done else self.admissible_actions(),
            reward=reward,
            done=self._done,
            success=self._done and self._page == DONE and self._score == 1.0,
            info=info,
        )

    # -- protocol --------------------------------------------------------------

    def reset(self) -> Observation:
        self._init_state()
        return self._observation()

    def step(self, action: str) -> Observation:
        if self._done:
            return self._observation(already_done=True)
        self._steps += 1
        reward, problem = self._apply(action if isinstance(action, str) else "")
        if not self._done and self._steps >= self.max_steps:
            self._done = True
            return self._observation(reward, invalid=problem is not None, truncated=True)
        if problem is not None:  # the unchanged page, as the original WebAgentTextEnv
            return self._observation(reward, invalid=True, problem=problem)
        return self._observation(reward, invalid=False)

    def _apply(self, action: str) -> tuple[float, str | None]:
        """Execute one action; returns (reward, reason it was invalid or None)."""
        name, arg = parse_action(action)
        if arg is None:
            shown = _shorten(action) if action.strip() else "(empty)"
            return 0.0, f"\"{shown}\" is not of the form search[...] or click[...]"
        arg = arg.lower()
        if name == "search":
            self._search(arg)
            return 0.0, None
        if name != "click":
            return 0.0, f"unknown action \"{_shorten(name, 30)}\"; use search[...] or click[...]"
        target = self._clickables.get(arg)
        if target is None:
            return 0.0, f"\"{_shorten(arg)}\" is not clickable on this page"
        kind, payload = target
        if kind == "product":
            self._asin, self._page = payload, ITEM
        elif kind == "option":
            self._options[payload] = arg
        elif payload == BUY_NOW:
            return self._buy(), None
        elif payload == BACK_TO_SEARCH:
            self._page, self._keywords, self._results = SEARCH, "", []
            self._asin, self._options = None, {}
        elif payload == NEXT_PAGE:
            self._page_no += 1
        elif payload == PREV_PAGE:
            if self._page == RESULTS:
                self._page_no -= 1
            elif self._page == ITEM:
                self._show_results(self._keywords, self._page_no)
            else:
                self._page = ITEM
        else:  # description / features / reviews
            self._page, self._sub_page = ITEM_SUB, payload
        self._render()
        return 0.0, None

    def _search(self, keywords: str) -> None:
        self._show_results(keywords, 1)
        self._render()

    def _show_results(self, keywords: str, page_no: int) -> None:
        """Results page (``search_results``): resets the chosen product and options."""
        self._page, self._keywords, self._page_no = RESULTS, keywords, page_no
        self._results = self.catalogue.search(keywords)
        self._asin, self._options = None, {}

    def _buy(self) -> float:
        product = self.catalogue.product(self._asin)
        price = self.catalogue.product_prices[self._asin]
        self._score, self._reward_info = get_reward(product, self.goal, price, self._options)
        self._page, self._done = DONE, True
        self._render()
        return self._score

    # -- oracle ----------------------------------------------------------------

    def expert_action(self) -> str | None:
        """Scripted oracle: search, page to and open the goal's product, click the
        product option values that best match the goal options, buy."""
        if self._done:
            return None
        target = self.goal["asin"]
        if self._page == SEARCH:
            return f"search[{self._expert_query()}]"
        if self._page == RESULTS:
            asins = [p["asin"] for p in self._results]
            if target not in asins:
                return f"click[{BACK_TO_SEARCH}]"
            wanted_page = asins.index(target) // PRODUCT_WINDOW + 1
            if wanted_page == self._page_no:
                return f"click[{target.lower()}]"
            return f"click[{NEXT_PAGE if wanted_page > self._page_no else PREV_PAGE}]"
        if self._page == ITEM_SUB or self._asin != target:
            return f"click[{PREV_PAGE}]"
        for value, option_name in self._expert_option_plan():
            if self._options.get(option_name) != value:
                return f"click[{value}]"
        return f"click[{BUY_NOW}]"

    def _expert_option_plan(self) -> list[tuple[str, str]]:
        """(value, option name it sets) per goal option: the product's best fuzzy match."""
        plan: dict[str, str] = {}
        for wanted in goal_option_values(self.goal):
            wanted = wanted.lower()
            wanted_n = normalize_color(wanted)
            best, best_key = None, (FUZZY_THRESHOLD, True)
            for value, (kind, option_name) in self._clickables.items():
                if kind != "option" or option_name in plan.values():
                    continue
                key = (fuzzy_match_score(normalize_color(value), wanted_n), value == wanted)
                if key > best_key:  # best score; an exact value wins ties
                    best, best_key = value, key
            if best is not None:
                plan[best] = self._clickables[best][1]
        return list(plan.items())

    def shopper_action(self, actions: Sequence[str] = ()) -> str | None:
        """:func:`visible_shopper_action` on the current page (``actions``: the
        actions taken so far in this episode)."""
        if self._done:
            return None
        return visible_shopper_action(self.instruction, self._text, self.admissible_actions(), actions)

    def close(self) -> None:
        """Nothing to release (pure Python state)."""


# ---------------------------------------------------------------------------
# Visible-information shopper (demonstrations a policy can imitate)
# ---------------------------------------------------------------------------

_PAGE_HEADER_RE = re.compile(r"^Page \d+ \(Total results: \d+\)$")
_PRICE_LIMIT_RE = re.compile(r"price lower than ([0-9]+(?:\.[0-9]+)?) dollars")
_DOLLARS_RE = re.compile(r"\$([0-9]+(?:\.[0-9]+)?)")
_ITEM_BUTTONS = frozenset((BACK_TO_SEARCH, PREV_PAGE, NEXT_PAGE, BUY_NOW, *SUB_PAGES))
SHOPPER_MAX_PAGES = 3  # result pages the shopper reads before settling for the first item


def _click_arg(action: str) -> str | None:
    m = re.fullmatch(r"click\[(.+)\]", action.strip())
    return m.group(1) if m else None


def shopper_query(instruction: str) -> str:
    """The shopper's search: the instruction without its price clause (lowercased)."""
    return instruction.split(", and price lower than")[0].strip().lower()


def _mentions(text: str, phrase: str) -> bool:
    return re.search(rf"(?<![a-z0-9]){re.escape(phrase)}(?![a-z0-9])", text) is not None


def visible_shopper_action(
    instruction: str, observation: str, admissible: Sequence[str], actions: Sequence[str] = ()
) -> str | None:
    """A scripted shopper that uses **only what the agent sees**: the instruction, the
    current observation text, the admissible actions and its own previous actions.

    Why it exists: :meth:`WebShopEpisode.expert_action` knows the goal's hidden product
    id, so on a results page it clicks a product whose title often shows none of the
    wanted attributes.  A small model cloned on such labels learns to click an
    arbitrary product (0/32 successes in the cpu profile's first warm start).  This
    shopper's choices are a function of the prompt, so behaviour cloning can learn
    them; it is the ``sft.demonstrator="shopper"`` option.  Rules:

    * search page: ``search[`` instruction without the price clause ``]``;
    * results page: among the listed products whose (lowest) price is within the
      instruction's limit, click the one with the most title attributes (the
      ``- a, b`` suffix) named in the instruction, then the most words of the title's
      name shared with the instruction (ties: higher rank); no product within the
      limit: ``next >`` up to page :data:`SHOPPER_MAX_PAGES`, then the first product;
    * item page: click each option value the instruction names (whole-word match;
      a value contained in a longer matching value is skipped) unless already
      clicked since the product was opened, then ``buy now``;
    * description/features/reviews page: ``< prev``.

    Returns ``None`` on a page without admissible actions (done).
    """
    adm = set(admissible)
    instr = instruction.lower()
    if not adm:
        return None
    if SEARCH_PLACEHOLDER in adm:
        return f"search[{shopper_query(instruction)}]"
    clicks = [a for a in (_click_arg(x) for x in admissible) if a is not None]
    pieces = [p.strip() for p in observation.split(" [SEP] ")]
    if f"click[{BUY_NOW}]" in adm:  # item page
        since_open = set()  # option values clicked since this product page was opened
        for act in reversed(actions):
            arg = _click_arg(act)
            if arg is None:
                if act.strip().startswith("search["):
                    break
            elif arg in (BACK_TO_SEARCH, PREV_PAGE) or (arg not in _ITEM_BUTTONS and arg not in clicks):
                break  # left the page, or the product click that opened it
            elif arg not in _ITEM_BUTTONS:
                since_open.add(arg)
        values = [c for c in clicks if c not in _ITEM_BUTTONS and _mentions(instr, c.lower())]
        values = [v for v in values if not any(v != w and _mentions(w.lower(), v.lower()) for w in values)]
        for value in values:
            if value not in since_open:
                return f"click[{value}]"
        return f"click[{BUY_NOW}]"
    header = next((i for i, p in enumerate(pieces) if _PAGE_HEADER_RE.match(p)), None)
    if header is None:  # a description / features / reviews page
        return f"click[{PREV_PAGE}]" if f"click[{PREV_PAGE}]" in adm else sorted(adm)[0]
    m = _PRICE_LIMIT_RE.search(instr)
    limit = float(m.group(1)) if m else float("inf")
    words = set(re.findall(r"[a-z0-9]+", instr))
    products, i = [], header + 1
    while i < len(pieces):
        if f"click[{pieces[i].lower()}]" in adm and pieces[i].lower() not in _ITEM_BUTTONS and i + 2 < len(pieces):
            products.append((pieces[i].lower(), pieces[i + 1], pieces[i + 2]))
            i += 3
        else:
            i += 1
    best = None
    for rank, (asin, title, price_text) in enumerate(products):
        prices = [float(x) for x in _DOLLARS_RE.findall(price_text)]
        if not prices or min(prices) > limit:
            continue
        name, _, attrs = title.lower().partition(" - ")
        named = sum(_mentions(instr, a.strip()) for a in attrs.split(",") if a.strip())
        key = (named, len(set(re.findall(r"[a-z0-9]+", name)) & words), -rank)
        if best is None or key > best[0]:
            best = (key, asin)
    if best is not None:
        return f"click[{best[1]}]"
    page = int(re.findall(r"\d+", pieces[header])[0])
    if f"click[{NEXT_PAGE}]" in adm and page < SHOPPER_MAX_PAGES:
        return f"click[{NEXT_PAGE}]"
    return f"click[{products[0][0]}]" if products else f"click[{BACK_TO_SEARCH}]"


# ---------------------------------------------------------------------------
# Task pool
# ---------------------------------------------------------------------------


@dataclass
class WebShopTask:
    """One goal; ``spawn`` gives independent episodes sharing the expert's query."""

    task_id: str
    instruction: str
    goal: dict
    catalogue: WebShopCatalogue
    max_steps: int = MAX_STEPS

    def __post_init__(self) -> None:
        self._expert_query: str | None = None

    def expert_query(self) -> str:
        """First of goal query / instruction (without price clause) / product title
        whose top-50 results contain the goal's product (computed once per task)."""
        if self._expert_query is None:
            product = self.catalogue.product(self.goal["asin"])
            candidates = [
                self.goal["query"],
                self.instruction.split(", and price lower than")[0],
                product["Title"],
            ]
            self._expert_query = next(
                (q.lower() for q in candidates
                 if any(p["asin"] == product["asin"] for p in self.catalogue.search(q.lower()))),
                candidates[0].lower(),
            )
        return self._expert_query

    def spawn(self) -> WebShopEpisode:
        return WebShopEpisode(self.catalogue, self.goal, self.max_steps, self.expert_query)


class WebShopPool:
    """WebShop tasks: ``test`` = shuffled goals ``[:n_test]`` (500), ``train`` = the rest."""

    name = "webshop"
    max_steps = MAX_STEPS

    def __init__(self, catalogue: WebShopCatalogue, n_test: int = N_TEST_GOALS, source: str = GENERATED) -> None:
        self.catalogue = catalogue
        self.data_source = source  # the real-data folder or "generated" (cache keys and manifests record it)
        n_test = min(n_test, len(catalogue.goals))
        self._goals = {"test": catalogue.goals[:n_test], "train": catalogue.goals[n_test:]}

    def splits(self) -> dict[str, int]:
        return {split: len(goals) for split, goals in self._goals.items()}

    def goal(self, split: str, index: int) -> dict:
        check_split(self, split, index)
        return self._goals[split][index]

    def open(self, split: str, index: int) -> WebShopTask:
        goal = self.goal(split, index)
        return WebShopTask(f"webshop/{split}/{index}", goal["instruction_text"], goal,
                           self.catalogue, self.max_steps)


def make_webshop_pool(
    data_dir: str | os.PathLike | None = None,
    seed: int = 0,
    *,
    n_products: int = DEFAULT_N_PRODUCTS,
    n_test: int = N_TEST_GOALS,
) -> WebShopPool:
    """The WebShop task pool (splits ``test``: 500, ``train``: the remaining goals).

    Args:
        data_dir: folder with the original data files; ``None`` uses ``$WEBSHOP_DATA``
            if set, otherwise the offline generated catalogue (no data needed):
            :func:`~sprpo_lib.agent.envs.base.resolve_data_dir`, the rule of both environments.
        seed: generation seed of the offline catalogue; for real data, the seed of
            the price draws the original leaves unseeded.
        n_products: size of the generated catalogue (ignored for real data).
        n_test: number of test goals (500 in the paper).

    Raises:
        WebShopDataError: ``data_dir``/``$WEBSHOP_DATA`` is missing or incomplete.
    """
    return WebShopPool(get_catalogue(data_dir, seed, n_products), n_test, data_source("webshop", data_dir))
