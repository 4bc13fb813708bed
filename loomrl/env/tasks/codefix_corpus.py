"""A corpus of SWE-style codefix tasks: tiny stdlib-only Python repositories, each with one realistic
logic bug, the issue a user would file about it, hidden unittest tests and the golden patch.

Every family is a bug template written once as the *fixed* source plus a (good, bad) snippet pair;
the buggy repository is the fixed source with that one snippet swapped, so the golden patch is always
a single-spot change. Each family is instantiated three times with different package, module and
function names, constants and data, so the variants are different repositories. Everything is
deterministic: no randomness, the same list on every call.

Families: clamp, range_sum, is_prime, mean_empty, char_case, dedupe_order, recurrence_base,
binary_search, unit_formula, word_freq, flatten, running_extreme, chunk, merge_precedence,
parse_kv, mutate_arg.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import textwrap
from collections import Counter
from collections.abc import Callable
from itertools import accumulate

from loomrl.env.tasks.codefix_types import CodefixTask

# Declared perturbations, handed out to every fourth task in order (a quarter of the corpus).
# The environment applies them; tasks and their tests never depend on them.
_PERTURBATIONS: list[dict] = [
    {"env": {"LC_ALL": "C", "APP_MODE": "test"}}, {"disable_tools": ["bash"]}, {"layout": "src"},
    {"broken_dependency": "requests"}, {"env": {"TZ": "UTC", "CI": "true"}}, {"broken_dependency": "yaml"}]


# Each family: its generator and its three variants (different names, constants and data), in the order
# the generators are defined below.
_FAMILIES: list[tuple[Callable[..., CodefixTask], tuple[dict, ...]]] = []


def _variants(*variants: dict) -> Callable[[Callable[..., CodefixTask]], Callable[..., CodefixTask]]:
    """Register the decorated family generator with its variants (the keyword arguments of each)."""
    def register(gen: Callable[..., CodefixTask]) -> Callable[..., CodefixTask]:
        _FAMILIES.append((gen, variants))
        return gen

    return register


def _src(text: str) -> str:
    """Dedent a triple-quoted template and drop its leading newline."""
    return textwrap.dedent(text).lstrip("\n")


def _test(name: str, line: str) -> str:
    """A test method whose body is one line."""
    return f"def test_{name}(self):\n    {line}\n"


def _tests(*methods: str) -> str:
    """Test methods (one-line ones from _test, others as templates), a blank line between them."""
    return "\n".join(_src(m) for m in methods)


def _task(family: str, variant: int, *, pkg: str, module: str, exports: list[str], summary: str, usage: str,
          issue: str, fixed: str, bug: tuple[str, str], tests: str) -> CodefixTask:
    """Assemble one repository: README, package __init__, the buggy module, hidden tests and golden patch."""
    good, bad = bug
    # Exactly one occurrence keeps the bug (and so the golden patch) a single-spot change.
    if fixed.count(good) != 1:
        raise ValueError(f"codefix-{family}-{variant}: bug snippet must occur once in the fixed source")
    names = ", ".join(exports)
    all_names = ", ".join(f'"{name}"' for name in exports)
    path = f"{pkg}/{module}.py"
    camel = "".join(part.title() for part in module.split("_"))
    test_module = (f"import unittest\n\nfrom {pkg}.{module} import {names}\n\n\n"
                   f"class Test{camel}(unittest.TestCase):\n{textwrap.indent(_src(tests), '    ')}\n\n"
                   'if __name__ == "__main__":\n    unittest.main()\n')
    return CodefixTask(
        task_id=f"codefix-{family}-{variant}", family=family, issue=issue,
        files={
            "README.md": f"# {pkg}\n\n{summary}\n\n## Usage\n\n```python\nfrom {pkg} import {names}\n\n{usage}\n```\n",
            f"{pkg}/__init__.py": f'"""{summary}"""\n\nfrom .{module} import {names}\n\n__all__ = [{all_names}]\n',
            path: fixed.replace(good, bad)},
        golden_patch={path: fixed},
        hidden_tests={"tests_hidden/__init__.py": "", f"tests_hidden/test_{module}.py": test_module})


@_variants(dict(pkg="mathutils", module="bounds", func="clamp", params=("value", "low", "high"), lo=0, hi=3, above=5,
                inside=1, below=-2),
           dict(pkg="audiokit", module="gain", func="limit_gain", params=("db", "floor", "ceiling"), lo=-6.0, hi=6.0,
                above=12.5, inside=-1.5, below=-20.0),
           dict(pkg="pixelops", module="channels", func="clamp_channel", params=("level", "lo", "hi"), lo=0, hi=255,
                above=300, inside=128, below=-5))
def _clamp(v, *, pkg, module, func, params, lo, hi, above, inside, below):
    """min/max nested the wrong way round: every value collapses onto the lower bound."""
    x, a, b = params
    fixed = _src(f'''
        def {func}({x}, {a}, {b}):
            """Return {x} limited to the closed interval [{a}, {b}]."""
            if {a} > {b}:
                raise ValueError("{a} must not exceed {b}")
            return max({a}, min({x}, {b}))
        ''')
    tests = _tests(
        _test("above_range_gives_upper_bound", f"self.assertEqual({func}({above}, {lo}, {hi}), {hi})"),
        _test("inside_range_is_unchanged", f"self.assertEqual({func}({inside}, {lo}, {hi}), {inside})"),
        _test("below_range_gives_lower_bound", f"self.assertEqual({func}({below}, {lo}, {hi}), {lo})"),
        f'''
        def test_inverted_bounds_are_rejected(self):
            with self.assertRaises(ValueError):
                {func}({inside}, {hi}, {lo})
        ''')
    return _task(
        "clamp", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}` keeps a value inside a closed interval.",
        usage=f"{func}({above}, {lo}, {hi})  # -> {hi}\n{func}({inside}, {lo}, {hi})  # -> {inside}",
        issue=f"In {pkg}, `{func}({above}, {lo}, {hi})` returns {lo}, but {above} is above the upper bound so "
              f"I expected {hi}. Values inside the interval seem to come back as {lo} too.",
        fixed=fixed, bug=(f"max({a}, min({x}, {b}))", f"min({a}, max({x}, {b}))"), tests=tests)


@_variants(dict(pkg="numkit", module="series", func="sum_between", term="i", value=lambda i: i, what="i", start=1,
                stop=5),
           dict(pkg="geomkit", module="pyramids", func="sum_of_squares", term="i * i", value=lambda i: i * i,
                what="i squared", start=1, stop=4),
           dict(pkg="booking", module="pricing", func="stay_price", term="100 + 5 * i", value=lambda i: 100 + 5 * i,
                what="the nightly rate 100 + 5 * i", start=3, stop=6))
def _range_sum(v, *, pkg, module, func, term, value, what, start, stop):
    """Half-open range where the README promises an inclusive one: the last term is lost."""
    def total(a, b):
        return sum(value(i) for i in range(a, b + 1))

    fixed = _src(f'''
        def {func}(start, stop):
            """Return the sum of {what} for every integer i from start to stop, both ends included."""
            if start > stop:
                return 0
            return sum({term} for i in range(start, stop + 1))
        ''')
    tests = _tests(
        _test("both_ends_included", f"self.assertEqual({func}({start}, {stop}), {total(start, stop)})"),
        _test("single_value", f"self.assertEqual({func}(4, 4), {value(4)})"),
        _test("negative_start", f"self.assertEqual({func}(-3, 2), {total(-3, 2)})"),
        _test("start_after_stop_is_zero", f"self.assertEqual({func}(5, 2), 0)"))
    return _task(
        "range_sum", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}(start, stop)` sums {what} over an inclusive range of integers.",
        usage=f"{func}({start}, {stop})  # -> {total(start, stop)}",
        issue=f"`{pkg}.{func}({start}, {stop})` returns {total(start, stop - 1)}, but the README says both ends "
              f"are included, so I expected {total(start, stop)}.",
        fixed=fixed, bug=("range(start, stop + 1)", "range(start, stop)"), tests=tests)


@_variants(dict(pkg="numtheory", module="primes", check="is_prime", listing="primes_below", following="next_prime",
                cited="check"),
           dict(pkg="sievekit", module="listing", check="isprime", listing="primes_under", following="prime_at_least",
                cited="listing"),
           dict(pkg="hashsize", module="tables", check="is_prime_number", listing="small_primes",
                following="next_table_size", cited="following"))
def _is_prime(v, *, pkg, module, check, listing, following, cited):
    """Guard one too low: 1 counts as prime, which leaks into the helpers built on the check."""
    fixed = _src(f'''
        from math import isqrt


        def {check}(n):
            """Return True if n is a prime number."""
            if n < 2:
                return False
            for divisor in range(2, isqrt(n) + 1):
                if n % divisor == 0:
                    return False
            return True


        def {listing}(limit):
            """Return the primes smaller than limit, in increasing order."""
            return [n for n in range(limit) if {check}(n)]


        def {following}(n):
            """Return the smallest prime greater than or equal to n."""
            while not {check}(n):
                n += 1
            return n
        ''')
    tests = _tests(
        _test("one_is_not_prime", f"self.assertFalse({check}(1))"),
        f'''
        def test_small_numbers(self):
            for n in (2, 3, 13, 97):
                self.assertTrue({check}(n), n)
            for n in (-7, 0, 9, 91):
                self.assertFalse({check}(n), n)
        ''',
        _test("primes_below", f"self.assertEqual({listing}(20), [2, 3, 5, 7, 11, 13, 17, 19])"),
        f'''
        def test_next_prime(self):
            self.assertEqual({following}(0), 2)
            self.assertEqual({following}(14), 17)
            self.assertEqual({following}(17), 17)
        ''')
    # Each variant reports the symptom through a different entry point.
    issues = {
        "check": f"`{pkg}.{check}(1)` returns True, but 1 is not a prime number.",
        "listing": f"`{pkg}.{listing}(10)` returns [1, 2, 3, 5, 7]; 1 should not be in that list.",
        "following": f"`{pkg}.{following}(0)` returns 1, but the smallest prime is 2.",
    }
    return _task(
        "is_prime", v, pkg=pkg, module=module, exports=[check, listing, following],
        summary="Small helpers for prime numbers.",
        usage=f"{check}(13)  # -> True\n{listing}(10)  # -> [2, 3, 5, 7]\n{following}(14)  # -> 17",
        issue=issues[cited], fixed=fixed, bug=("if n < 2:", "if n < 1:"), tests=tests)


@_variants(dict(pkg="stats", module="averages", func="average", arg="values", empty=0.0, sample=[2, 4, 9]),
           dict(pkg="monitor", module="latency", func="mean_latency", arg="samples", empty=None,
                sample=[12.5, 7.5, 30.0, 10.0]),
           dict(pkg="gradebook", module="report", func="class_average", arg="scores", empty=0,
                sample=[88, 92, 75, 61, 90]))
def _mean_empty(v, *, pkg, module, func, arg, empty, sample):
    """Missing empty-input guard: the mean of nothing divides by zero instead of returning the default."""
    fixed = _src(f'''
        def {func}({arg}):
            """Return the arithmetic mean of {arg} (any iterable), or {empty!r} when there are none."""
            {arg} = list({arg})
            if not {arg}:
                return {empty!r}
            return sum({arg}) / len({arg})
        ''')
    mean = sum(sample) / len(sample)
    tests = _tests(
        _test("empty_returns_default", f"self.assertEqual({func}([]), {empty!r})"),
        _test("mean", f"self.assertAlmostEqual({func}({sample!r}), {mean!r})"),
        _test("accepts_a_generator", f"self.assertAlmostEqual({func}(x for x in {sample!r}), {mean!r})"),
        _test("single_value", f"self.assertEqual({func}([7]), 7)"))
    return _task(
        "mean_empty", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}` averages numbers and returns {empty!r} when there are none.",
        usage=f"{func}({sample!r})  # -> {mean!r}\n{func}([])  # -> {empty!r}",
        issue=f"`{pkg}.{func}([])` raises ZeroDivisionError. The README says it returns {empty!r} when "
              f"there are no {arg}.",
        fixed=fixed, bug=(f"    if not {arg}:\n        return {empty!r}\n", ""), tests=tests)


@_variants(dict(pkg="textstats", module="letters", func="count_vowels", const="VOWELS", chars="aeiou", what="vowels",
                text="education", mixed="Hello World, AEIOU"),
           dict(pkg="genomics", module="content", func="gc_count", const="GC_BASES", chars="gc", what="G and C bases",
                text="acgtggca", mixed="ACGTacgtGGcc"),
           dict(pkg="phonetics", module="sounds", func="count_sibilants", const="SIBILANTS", chars="sz",
                what="letters s and z", text="sizzling seas", mixed="Sizzling Seas"))
def _char_case(v, *, pkg, module, func, const, chars, what, text, mixed):
    """Case-sensitive membership test: upper-case letters are never counted."""
    def count(s):
        return sum(ch in chars for ch in s.lower())

    fixed = _src(f'''
        {const} = "{chars}"


        def {func}(text):
            """Count the {what} in text; upper- and lower-case letters both count."""
            return sum(1 for ch in text.lower() if ch in {const})
        ''')
    tests = _tests(
        _test("upper_case_counts", f"self.assertEqual({func}({text.upper()!r}), {count(text)})"),
        _test("mixed_case", f"self.assertEqual({func}({mixed!r}), {count(mixed)})"),
        _test("lower_case", f"self.assertEqual({func}({text.lower()!r}), {count(text)})"),
        _test("empty_text", f'self.assertEqual({func}(""), 0)'))
    return _task(
        "char_case", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}` counts the {what} in a piece of text, in either case.",
        usage=f"{func}({mixed!r})  # -> {count(mixed)}",
        issue=f"`{pkg}.{func}({mixed!r})` returns {sum(ch in chars for ch in mixed)}, expected {count(mixed)}: "
              f"upper-case {what} are not counted.",
        fixed=fixed, bug=("for ch in text.lower() if", "for ch in text if"), tests=tests)


@_variants(dict(pkg="listkit", module="unique", func="dedupe", arg="items", sample=["b", "a", "b", "c", "a"],
                unique_sorted=["a", "b", "c"]),
           dict(pkg="eventlog", module="ids", func="unique_ids", arg="event_ids", sample=[42, 7, 42, 3, 7, 100],
                unique_sorted=[1, 2, 3]),
           dict(pkg="tagger", module="tags", func="distinct_tags", arg="tags",
                sample=["python", "api", "python", "web", "api"], unique_sorted=["api", "python", "web"]))
def _dedupe_order(v, *, pkg, module, func, arg, sample, unique_sorted):
    """Deduplicating through a set loses the first-seen order callers rely on."""
    wanted = list(dict.fromkeys(sample))
    fixed = _src(f'''
        def {func}({arg}):
            """Return {arg} without duplicates, each kept where it first appears."""
            return list(dict.fromkeys({arg}))
        ''')
    tests = _tests(
        _test("first_seen_order_is_kept", f"self.assertEqual({func}({sample!r}), {wanted!r})"),
        _test("already_unique_is_unchanged", f"self.assertEqual({func}({unique_sorted!r}), {unique_sorted!r})"),
        f'''
        def test_input_is_not_modified(self):
            data = {sample!r}
            {func}(data)
            self.assertEqual(data, {sample!r})
        ''',
        _test("empty", f"self.assertEqual({func}([]), [])"))
    return _task(
        "dedupe_order", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}` drops duplicates while keeping the original order.",
        usage=f"{func}({sample!r})  # -> {wanted!r}",
        issue=f"`{pkg}.{func}({sample!r})` returns {sorted(set(sample))!r}; I expected {wanted!r}, "
              "in the order the items first appear.",
        fixed=fixed, bug=(f"list(dict.fromkeys({arg}))", f"sorted(set({arg}))"), tests=tests)


@_variants(dict(pkg="seqs", module="fibonacci", func="fib", name="Fibonacci", p=1, q=1),
           dict(pkg="pellkit", module="numbers", func="pell", name="Pell", p=2, q=1),
           dict(pkg="tilings", module="counts", func="jacobsthal", name="Jacobsthal", p=1, q=2))
def _recurrence_base(v, *, pkg, module, func, name, p, q):
    """Wrong base case (1 instead of n) for a(n) = p*a(n-1) + q*a(n-2): a(0) and every later term are off."""
    def seq(n, base0):
        a, b = base0, 1
        for _ in range(n):
            a, b = b, p * b + q * a
        return a

    def times(c, call):
        return call if c == 1 else f"{c} * {call}"

    step = f"{times(p, f'{func}(n - 1)')} + {times(q, f'{func}(n - 2)')}"
    fixed = _src(f'''
        from functools import lru_cache


        @lru_cache(maxsize=None)
        def {func}(n):
            """Return the n-th {name} number, starting {func}(0) = 0, {func}(1) = 1."""
            if n < 0:
                raise ValueError("n must be non-negative")
            if n <= 1:
                return n
            return {step}
        ''')
    tests = _tests(
        _test("zero", f"self.assertEqual({func}(0), 0)"),
        _test("one", f"self.assertEqual({func}(1), 1)"),
        f'''
        def test_later_terms(self):
            self.assertEqual([{func}(n) for n in range(2, 7)], {[seq(n, 0) for n in range(2, 7)]!r})
            self.assertEqual({func}(10), {seq(10, 0)})

        def test_negative_is_rejected(self):
            with self.assertRaises(ValueError):
                {func}(-1)
        ''')
    return _task(
        "recurrence_base", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}(n)` computes the {name} numbers.",
        usage=f"[{func}(n) for n in range(6)]  # -> {[seq(n, 0) for n in range(6)]!r}",
        issue=f"`{pkg}.{func}(0)` returns 1, but the 0th {name} number is 0. Later values are wrong as well: "
              f"`{func}(10)` gives {seq(10, 1)} instead of {seq(10, 0)}.",
        fixed=fixed, bug=("return n\n", "return 1\n"), tests=tests)


@_variants(dict(pkg="searchkit", module="bisect_search", func="find_index", items=[2, 3, 5, 7, 11], missing=4),
           dict(pkg="lexicon", module="lookup", func="find_word",
                items=["apple", "banana", "cherry", "grape", "melon", "peach"], missing="kiwi"),
           dict(pkg="versions", module="index", func="locate", items=[0.5, 1.0, 1.5, 2.25], missing=2.0))
def _binary_search(v, *, pkg, module, func, items, missing):
    """Loop stops while lo == hi, so the last candidate (e.g. the final element) is never examined."""
    fixed = _src(f'''
        def {func}(items, target):
            """Return the index of target in the sorted list items, or -1 if it is not there."""
            lo, hi = 0, len(items) - 1
            while lo <= hi:
                mid = (lo + hi) // 2
                if items[mid] == target:
                    return mid
                if items[mid] < target:
                    lo = mid + 1
                else:
                    hi = mid - 1
            return -1
        ''')
    tests = _tests(
        _test("last_element", f"self.assertEqual({func}({items!r}, {items[-1]!r}), {len(items) - 1})"),
        f'''
        def test_every_element(self):
            for index, item in enumerate({items!r}):
                self.assertEqual({func}({items!r}, item), index)
        ''',
        _test("single_element", f"self.assertEqual({func}([{items[0]!r}], {items[0]!r}), 0)"),
        f'''
        def test_absent(self):
            self.assertEqual({func}({items!r}, {missing!r}), -1)
            self.assertEqual({func}([], {missing!r}), -1)
        ''')
    return _task(
        "binary_search", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}` looks a value up in a sorted list by binary search.",
        usage=f"{func}({items!r}, {items[1]!r})  # -> 1",
        issue=f"`{pkg}.{func}({items!r}, {items[-1]!r})` returns -1 although {items[-1]!r} is in the list "
              "(it is the last element).",
        fixed=fixed, bug=("while lo <= hi:", "while lo < hi:"), tests=tests)


@_variants(dict(pkg="weather", module="convert", func="celsius_to_fahrenheit", arg="celsius", src="Celsius",
                dst="Fahrenheit", expr="celsius * 9 / 5 + 32", bad_expr="(celsius + 32) * 9 / 5",
                points=[(100, 212.0), (0, 32.0), (-40, -40.0), (37, 98.6)], wrong="237.6"),
           dict(pkg="thermo", module="units", func="fahrenheit_to_celsius", arg="fahrenheit", src="Fahrenheit",
                dst="Celsius", expr="(fahrenheit - 32) * 5 / 9", bad_expr="fahrenheit - 32 * 5 / 9",
                points=[(212, 100.0), (32, 0.0), (-40, -40.0), (50, 10.0)], wrong="about 194.2"),
           dict(pkg="cryokit", module="scales", func="kelvin_to_fahrenheit", arg="kelvin", src="Kelvin",
                dst="Fahrenheit", expr="(kelvin - 273.15) * 9 / 5 + 32", bad_expr="kelvin - 273.15 * 9 / 5 + 32",
                points=[(273.15, 32.0), (373.15, 212.0), (0, -459.67), (233.15, -40.0)], wrong="about -186.5"))
def _unit_formula(v, *, pkg, module, func, arg, src, dst, expr, bad_expr, points, wrong):
    """Operator precedence slip in a conversion formula."""
    fixed = _src(f'''
        def {func}({arg}):
            """Convert a temperature from {src} to {dst}."""
            return {expr}
        ''')
    (ref_in, ref_out), *others = points
    tests = _tests(
        _test("reference_point", f"self.assertAlmostEqual({func}({ref_in!r}), {ref_out!r})"),
        f'''
        def test_other_points(self):
            for given, expected in {others!r}:
                self.assertAlmostEqual({func}(given), expected)
        ''',
        _test("result_is_float", f"self.assertIsInstance({func}({ref_in!r}), float)"))
    return _task(
        "unit_formula", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}` converts temperatures from {src} to {dst}.",
        usage=f"{func}({ref_in!r})  # -> {ref_out!r}",
        issue=f"`{pkg}.{func}({ref_in!r})` returns {wrong}, expected {ref_out!r}.",
        fixed=fixed, bug=(f"return {expr}", f"return {bad_expr}"), tests=tests)


@_variants(dict(pkg="textstats", module="freq", counts="word_counts", top="most_common_word", hits="occurrences",
                text="The cat sat. The cat ran, and the dog sat!", word="sat",
                top_text="Error! Retry, error? warning warning", cited="counts"),
           dict(pkg="seo", module="keywords", counts="keyword_counts", top="top_keyword", hits="keyword_hits",
                text="Cheap flights! Book flights, compare flights.", word="flights",
                top_text="Sale, sale! Buy now; buy now. now", cited="top"),
           dict(pkg="chatlog", module="tokens", counts="token_counts", top="top_token", hits="mentions",
                text="@here deploy? deploy! Deploy done, ok.", word="deploy", top_text="ship it. ship, ship! wait wait",
                cited="hits"))
def _word_freq(v, *, pkg, module, counts, top, hits, text, word, top_text, cited):
    """Splitting on whitespace keeps punctuation glued to words, so 'cat.' and 'cat' count apart."""
    words = re.findall(r"[a-z0-9']+", text.lower())
    fixed = _src(f'''
        import re
        from collections import Counter

        _WORD = re.compile(r"[a-z0-9']+")


        def _words(text):
            """Split text into lower-case words, leaving out punctuation."""
            return _WORD.findall(text.lower())


        def {counts}(text):
            """Return a dict mapping each word of text to how often it occurs."""
            return dict(Counter(_words(text)))


        def {top}(text):
            """Return the most frequent word of text (the earliest on ties), or None if there are no words."""
            counts = Counter(_words(text))
            if not counts:
                return None
            return counts.most_common(1)[0][0]


        def {hits}(text, word):
            """Return how often word occurs in text, ignoring case and punctuation."""
            return _words(text).count(word.lower())
        ''')
    top_word = Counter(re.findall(r"[a-z0-9']+", top_text.lower())).most_common(1)[0][0]
    tests = _tests(
        _test("counts_ignore_punctuation", f"self.assertEqual({counts}({text!r}), {dict(Counter(words))!r})"),
        _test("most_frequent_word", f"self.assertEqual({top}({top_text!r}), {top_word!r})"),
        _test("occurrences", f"self.assertEqual({hits}({text!r}, {word.title()!r}), {words.count(word)})"),
        f'''
        def test_plain_words_and_empty_text(self):
            self.assertEqual({counts}("a b a"), {{"a": 2, "b": 1}})
            self.assertEqual({counts}(""), {{}})
            self.assertIsNone({top}("  "))
        ''')
    issues = {
        "counts": f"`{pkg}.{counts}({text!r})` counts {word!r} more than once under different keys "
                  f"(with punctuation attached); I expected {word!r}: {words.count(word)}.",
        "top": f"`{pkg}.{top}({top_text!r})` does not return {top_word!r}, the word that occurs most often.",
        "hits": f"`{pkg}.{hits}({text!r}, {word!r})` returns {text.lower().split().count(word)}, "
                f"but {word!r} occurs {words.count(word)} times.",
    }
    return _task(
        "word_freq", v, pkg=pkg, module=module, exports=[counts, top, hits],
        summary="Word-frequency helpers; words are compared case-insensitively, punctuation is ignored.",
        usage=f'{counts}("The cat. The dog!")  # -> {{"the": 2, "cat": 1, "dog": 1}}',
        issue=issues[cited], fixed=fixed, bug=("_WORD.findall(text.lower())", "text.lower().split()"),
        tests=tests)


@_variants(dict(pkg="listkit", module="nested", func="flatten", types=(list,), kinds="lists",
                deep=[1, [2, [3, [4]]], 5]),
           dict(pkg="shapes", module="points", func="flatten_coords", types=(list, tuple), kinds="lists and tuples",
                deep=[(0, 1), [(2, 3), [(4, (5,))]]]),
           dict(pkg="playlists", module="tree", func="flatten_playlist", types=(list,), kinds="playlists",
                deep=["intro", ["song-a", ["song-b", ["song-c"]]], "outro"]))
def _flatten(v, *, pkg, module, func, types, kinds, deep):
    """Recursion replaced by a plain extend: only one level of nesting is removed."""
    def flat(items, depth):
        out = []
        for item in items:
            if isinstance(item, types):
                out.extend(flat(item, depth - 1) if depth > 1 else item)
            else:
                out.append(item)
        return out

    type_src = types[0].__name__ if len(types) == 1 else f"({', '.join(t.__name__ for t in types)})"
    fixed = _src(f'''
        def {func}(items):
            """Flatten arbitrarily nested {kinds} into one flat list, keeping the order of the elements."""
            flat = []
            for item in items:
                if isinstance(item, {type_src}):
                    flat.extend({func}(item))
                else:
                    flat.append(item)
            return flat
        ''')
    tests = _tests(
        _test("deep_nesting", f"self.assertEqual({func}({deep!r}), {flat(deep, 99)!r})"),
        _test("one_level", f"self.assertEqual({func}([1, [2, 3], 4]), [1, 2, 3, 4])"),
        _test("strings_are_kept_whole", f'self.assertEqual({func}(["ab", ["cd"]]), ["ab", "cd"])'),
        f'''
        def test_empty(self):
            self.assertEqual({func}([]), [])
            self.assertEqual({func}([[], [[]]]), [])
        ''')
    return _task(
        "flatten", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}` flattens nested {kinds} into a single list.",
        usage=f"{func}({deep!r})  # -> {flat(deep, 99)!r}",
        issue=f"`{pkg}.{func}({deep!r})` returns {flat(deep, 1)!r}; {kinds} nested more than one level "
              "deep are not flattened.",
        fixed=fixed, bug=(f"flat.extend({func}(item))", "flat.extend(item)"), tests=tests)


@_variants(dict(pkg="streams", module="running", func="running_max", pick=max, which="maximum", op=">", start="-inf",
                sample=[-5, -2, -8, -1], mixed=[3, -1, 4, 1, 5]),
           dict(pkg="prices", module="lows", func="running_min", pick=min, which="minimum", op="<", start="inf",
                sample=[12, 15, 9, 11], mixed=[-3, 4, -5, 0, -1]),
           dict(pkg="climate", module="records", func="high_water_mark", pick=max, which="maximum", op=">",
                start="-inf", sample=[-12.5, -7.0, -9.5, -3.0], mixed=[2.0, -1.5, 0.5, 4.0]))
def _running_extreme(v, *, pkg, module, func, pick, which, op, start, sample, mixed):
    """Accumulator seeded with 0 instead of the identity, wrong whenever all values lie on one side of 0."""
    def run(values, initial=None):
        out = list(accumulate(values, pick, initial=initial))
        return out[1:] if initial is not None else out

    fixed = _src(f'''
        def {func}(values):
            """Return the running {which}: element i is the {which} of values[0] .. values[i]."""
            result = []
            best = float("{start}")
            for value in values:
                if value {op} best:
                    best = value
                result.append(best)
            return result
        ''')
    tests = _tests(
        _test("same_sign_values", f"self.assertEqual({func}({sample!r}), {run(sample)!r})"),
        _test("mixed_values", f"self.assertEqual({func}({mixed!r}), {run(mixed)!r})"),
        f'''
        def test_single_and_empty(self):
            self.assertEqual({func}([{mixed[0]!r}]), [{mixed[0]!r}])
            self.assertEqual({func}([]), [])
        ''')
    return _task(
        "running_extreme", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}` computes the running {which} of a sequence.",
        usage=f"{func}({mixed!r})  # -> {run(mixed)!r}",
        issue=f"`{pkg}.{func}({sample!r})` returns {run(sample, 0)!r}, expected {run(sample)!r}.",
        fixed=fixed, bug=(f'best = float("{start}")', "best = 0"), tests=tests)


@_variants(dict(pkg="listkit", module="chunks", func="chunked", items_arg="items", size_arg="size",
                sample=[1, 2, 3, 4, 5, 6, 7], size=3),
           dict(pkg="uploader", module="batching", func="batches", items_arg="records", size_arg="batch_size",
                sample=["a", "b", "c", "d", "e"], size=2),
           dict(pkg="webapi", module="pages", func="paginate", items_arg="rows", size_arg="per_page",
                sample=list(range(10, 110, 10)), size=4))
def _chunk(v, *, pkg, module, func, items_arg, size_arg, sample, size):
    """Range stops one chunk early, dropping a shorter trailing chunk."""
    def split(items, n):
        return [items[i:i + n] for i in range(0, len(items), n)]

    fixed = _src(f'''
        def {func}({items_arg}, {size_arg}):
            """Split {items_arg} into consecutive lists of {size_arg} elements; the last one may be shorter."""
            if {size_arg} < 1:
                raise ValueError("{size_arg} must be at least 1")
            return [{items_arg}[i:i + {size_arg}] for i in range(0, len({items_arg}), {size_arg})]
        ''')
    exact = sample[:size * 2]
    tests = _tests(
        _test("shorter_last_chunk_is_kept", f"self.assertEqual({func}({sample!r}, {size}), {split(sample, size)!r})"),
        _test("exact_multiple", f"self.assertEqual({func}({exact!r}, {size}), {split(exact, size)!r})"),
        _test("size_larger_than_input", f"self.assertEqual({func}({sample[:2]!r}, 10), [{sample[:2]!r}])"),
        f'''
        def test_empty_and_invalid_size(self):
            self.assertEqual({func}([], {size}), [])
            with self.assertRaises(ValueError):
                {func}({sample!r}, 0)
        ''')
    return _task(
        "chunk", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}` splits a list into consecutive pieces of a fixed size.",
        usage=f"{func}({sample!r}, {size})  # -> {split(sample, size)!r}",
        issue=f"`{pkg}.{func}({sample!r}, {size})` returns {split(sample[:len(sample) // size * size], size)!r}; "
              f"the last, shorter piece {sample[len(sample) // size * size:]!r} is missing.",
        fixed=fixed, tests=tests,
        bug=(f"range(0, len({items_arg}), {size_arg})", f"range(0, len({items_arg}) - {size_arg} + 1, {size_arg})"))


@_variants(dict(pkg="settings", module="config", func="merge_config", base="defaults", extra="overrides",
                defaults={"debug": False, "port": 8000}, overrides={"debug": True}),
           dict(pkg="httpkit", module="headers", func="with_defaults", base="base", extra="extra",
                defaults={"Accept": "*/*", "User-Agent": "httpkit/1.0"}, overrides={"Accept": "application/json"}),
           dict(pkg="cliapp", module="options", func="resolve_options", base="config", extra="flags",
                defaults={"verbose": 0, "color": "auto", "jobs": 1}, overrides={"jobs": 4, "color": "never"}))
def _merge_precedence(v, *, pkg, module, func, base, extra, defaults, overrides):
    """Unpacking order reversed: the defaults overwrite the caller's explicit values."""
    merged = {**defaults, **overrides}
    fixed = _src(f'''
        def {func}({base}, {extra}):
            """Return a new dict with the keys of {base} and {extra}; values from {extra} win."""
            return {{**{base}, **{extra}}}
        ''')
    tests = _tests(
        _test("explicit_values_win", f"self.assertEqual({func}({defaults!r}, {overrides!r}), {merged!r})"),
        f'''
        def test_inputs_are_not_modified(self):
            {base}, {extra} = {defaults!r}, {overrides!r}
            {func}({base}, {extra})
            self.assertEqual(({base}, {extra}), ({defaults!r}, {overrides!r}))
        ''',
        _test("disjoint_keys", f'self.assertEqual({func}({{"a": 1}}, {{"b": 2}}), {{"a": 1, "b": 2}})'),
        f'''
        def test_empty_side(self):
            self.assertEqual({func}({defaults!r}, {{}}), {defaults!r})
            self.assertEqual({func}({{}}, {overrides!r}), {overrides!r})
        ''')
    return _task(
        "merge_precedence", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}({base}, {extra})` layers {extra} on top of {base}.",
        usage=f"{func}({defaults!r}, {overrides!r})\n# -> {merged!r}",
        issue=f"`{pkg}.{func}({defaults!r}, {overrides!r})` returns {({**overrides, **defaults})!r}; "
              f"the values I pass in `{extra}` are ignored for keys that also appear in `{base}`.",
        fixed=fixed, bug=(f"{{**{base}, **{extra}}}", f"{{**{extra}, **{base}}}"), tests=tests)


@_variants(dict(pkg="envfile", module="dotenv", func="parse_env", sep="=", what="environment files",
                line="DATABASE_URL=postgres://db/app?sslmode=require",
                expected_line=("DATABASE_URL", "postgres://db/app?sslmode=require")),
           dict(pkg="mailkit", module="headers", func="parse_headers", sep=":", what="mail headers",
                line="Date: Tue, 10 Jun 2025 10:30:00", expected_line=("Date", "Tue, 10 Jun 2025 10:30:00")),
           dict(pkg="k8stools", module="labels", func="parse_labels", sep="=", what="label files",
                line="token = c2VjcmV0==", expected_line=("token", "c2VjcmV0==")))
def _parse_kv(v, *, pkg, module, func, sep, line, expected_line, what):
    """Unbounded split: a value that itself contains the separator cannot be unpacked."""
    key, value = expected_line
    fixed = _src(f'''
        def {func}(text):
            """Parse "key{sep} value" {what} into a dict; blank lines and # comments are skipped."""
            result = {{}}
            for line in text.splitlines():
                line = line.strip()
                if not line or line.startswith("#"):
                    continue
                key, value = line.split("{sep}", 1)
                result[key.strip()] = value.strip()
            return result
        ''')
    tests = _tests(
        _test("value_containing_separator", f"self.assertEqual({func}({line!r}), {{{key!r}: {value!r}}})"),
        f'''
        def test_comments_and_blank_lines(self):
            text = "# header\\n\\nname{sep} demo\\n  mode {sep}fast  \\n"
            self.assertEqual({func}(text), {{"name": "demo", "mode": "fast"}})

        def test_several_lines(self):
            text = "a{sep}1\\n" + {line!r} + "\\nb{sep}2"
            self.assertEqual({func}(text), {{"a": "1", {key!r}: {value!r}, "b": "2"}})
        ''',
        _test("empty", f'self.assertEqual({func}(""), {{}})'))
    return _task(
        "parse_kv", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}` reads {what} written as `key{sep} value` lines.",
        usage=f"{func}({line!r})\n# -> {({key: value})!r}",
        issue=f"`{pkg}.{func}` raises `ValueError: too many values to unpack (expected 2)` on the line "
              f"{line!r}, which is valid input.",
        fixed=fixed, bug=(f'line.split("{sep}", 1)', f'line.split("{sep}")'), tests=tests)


@_variants(dict(pkg="leaderboard", module="ranking", func="top_scores", params="scores, n", arg="scores",
                copy_var="ranked", doc="Return the n highest scores, highest first.",
                body="ranked.sort(reverse=True)\nreturn ranked[:n]\n", call_args=", 2", sample=[70, 95, 80, 88],
                result=[95, 88], mutated=[95, 88, 80, 70]),
           dict(pkg="statskit", module="middle", func="median", params="values", arg="values", copy_var="ordered",
                doc="Return the median of a non-empty list of numbers.",
                body=("ordered.sort()\nmid = len(ordered) // 2\nif len(ordered) % 2:\n    return ordered[mid]\n"
                      "return (ordered[mid - 1] + ordered[mid]) / 2\n"), call_args="", sample=[5, 1, 4, 2], result=3.0,
                mutated=[1, 2, 4, 5]),
           dict(pkg="tagging", module="labels", func="with_tag", params="tags, tag", arg="tags", copy_var="result",
                doc="Return a copy of tags with tag appended unless it is already there.",
                body="if tag not in result:\n    result.append(tag)\nreturn result\n", call_args=', "urgent"',
                sample=["bug", "ui"], result=["bug", "ui", "urgent"], mutated=["bug", "ui", "urgent"]))
def _mutate_arg(v, *, pkg, module, func, params, arg, copy_var, body, doc, call_args, sample, result, mutated):
    """Working on the caller's list instead of a copy: the argument changes behind the caller's back."""
    fixed = _src(f'''
        def {func}({params}):
            """{doc}"""
            {copy_var} = list({arg})
        ''') + textwrap.indent(_src(body), "    ")
    tests = _tests(
        _test("result", f"self.assertEqual({func}({sample!r}{call_args}), {result!r})"),
        f'''
        def test_argument_is_not_modified(self):
            data = {sample!r}
            {func}(data{call_args})
            self.assertEqual(data, {sample!r})

        def test_repeated_calls_agree(self):
            data = {sample!r}
            self.assertEqual({func}(data{call_args}), {func}(data{call_args}))
        ''')
    return _task(
        "mutate_arg", v, pkg=pkg, module=module, exports=[func],
        summary=f"`{func}`: {doc[0].lower()}{doc[1:]}",
        usage=f"{func}({sample!r}{call_args})  # -> {result!r}",
        issue=f"Calling `{pkg}.{func}(data{call_args})` with data = {sample!r} changes my list: afterwards "
              f"data is {mutated!r}.",
        fixed=fixed, bug=(f"{copy_var} = list({arg})", f"{copy_var} = {arg}"), tests=tests)


def codefix_tasks() -> list[CodefixTask]:
    """All codefix tasks, family by family, variants 1..3; every fourth one carries a perturbation."""
    tasks = [gen(v, **params) for gen, variants in _FAMILIES for v, params in enumerate(variants, start=1)]
    for n in range(3, len(tasks), 4):
        # deepcopy so no two tasks share a mutable perturbation dict.
        extra = copy.deepcopy(_PERTURBATIONS[(n // 4) % len(_PERTURBATIONS)])
        tasks[n] = dataclasses.replace(tasks[n], perturbations=extra)
    return tasks
