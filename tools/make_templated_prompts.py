"""Write ``assets/train_prompts_templated.jsonl``: draft-training prompts made from templates.

The hand-written prompt set (``assets/train_prompts.jsonl``, 776 training prompts) was
used up by round 4 of the shipped draft; the draft's acceptance grows with the number of
*distinct* prompts it sees (README, "DFlash draft"). This script makes more of them
deterministically (seeded): word problems and competition-style problems with random
names and numbers, Python function specs in several phrasings, and writing / explaining
requests over a topic list. Every prompt is checked to share no 8-word sequence with the
evaluation sets (``../shared/eval``) or with the hand-written prompts.

    python tools/make_templated_prompts.py [--eval-dir ../shared/eval] [--seed 0]
"""
from __future__ import annotations

import argparse
import json
import random
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "src" / "dflash_server" / "assets"
OUT = ASSETS / "train_prompts_templated.jsonl"

NAMES = ["Amara", "Bilal", "Chen", "Dana", "Elif", "Farid", "Greta", "Hiro", "Ines", "Jonas", "Kemi", "Luca",
         "Maya", "Nikhil", "Olga", "Pablo", "Quinn", "Rosa", "Sami", "Tariq", "Uma", "Viktor", "Wen", "Ximena",
         "Yusuf", "Zoe", "Arjun", "Beatriz", "Callum", "Dmitri", "Esther", "Felix", "Hana", "Ivan", "Leila", "Mateo"]
ITEMS = [("apples", 1.25), ("notebooks", 3.5), ("pencils", 0.4), ("cupcakes", 2.75), ("tickets", 12.0),
         ("plants", 6.5), ("bracelets", 4.0), ("candles", 5.25), ("stickers", 0.3), ("mugs", 8.0)]

# ---- grade-school word problems: (template, answer-free parameters) -------------------------------
WORD = [
    "{a} has {n1} {item}. {b} gives {a} {n2} more, and then {a} gives away a third of the total, rounded down. How many {item} does {a} have left?",
    "{a} reads {n1} pages every weekday and {n2} pages on each weekend day. How many pages does {a} read in {w} weeks?",
    "A bakery makes {n3} loaves of bread each morning. It sells {p}% of them before noon and half of the rest in the afternoon. How many loaves are left at closing time?",
    "{a} buys {n1} {item} at ${price} each and pays with a ${bill} bill. How much change does {a} get?",
    "A train leaves at {h1}:{m1:02d} and travels {d} km at an average speed of {v} km per hour. At what time does it arrive?",
    "{a} is {n1} years old. {b} is {k} times as old as {a} was {n2} years ago. How old is {b} now, and how old will {b} be in {w} years?",
    "A rectangular garden is {n1} m long and {n2} m wide. A path {k} m wide runs all around the outside of it. What is the area of the path?",
    "{a} saves ${n3} a month. Rent goes up by {p}% and {a} decides to save {k} fewer dollars each month from then on. How much does {a} save in a year if the change happens after {w} months?",
    "A water tank holds {n3} liters. One pipe fills it at {n1} liters per minute while a leak drains {k} liters per minute. Starting empty, how many minutes until it is full?",
    "{a} and {b} share {n3} marbles in the ratio {k}:{w}. {a} then gives {n1} marbles to {b}. How many marbles does each of them have now?",
    "A shop sells {item} in packs of {k} for ${price} or singly at ${single} each. What is the cheapest way to buy {n1} {item}, and what does it cost?",
    "{a} runs {d} km on Monday, and each day after that runs {k} km more than the day before. How far has {a} run in total by the end of Sunday?",
    "A class of {n1} students voted for a trip. {p}% chose the museum, {k} students chose the zoo, and the rest chose the beach. How many chose the beach?",
    "A recipe for {k} people needs {n2} eggs and {n1} grams of flour. How much of each is needed to cook for {w2} people?",
    "{a} worked {n1} hours at ${wage} an hour and {k} hours of overtime at one and a half times that rate. What did {a} earn in total?",
    "A car uses {k} liters of fuel per 100 km. Fuel costs ${fuel} per liter. How much does a round trip of {d} km each way cost?",
    "{a} plants {n1} rows of tomatoes with {k} plants in each row. Each plant gives about {n2} tomatoes, and {p}% are eaten by birds. How many tomatoes does {a} harvest?",
    "In a library, {p}% of the {n3} books are fiction. Of the fiction books, one in {k} is a mystery. How many mystery books are there?",
    "{a} has ${n3}. {a} spends a quarter of it on a jacket and ${n1} on shoes, then puts half of what is left in the bank. How much cash does {a} have now?",
    "A printer prints {n1} pages a minute. A job of {n3} pages starts at {h1}:{m1:02d}, and the printer pauses for {k} minutes halfway through. When does the job finish?",
]
WORD_FORMS = ["Question: {q}\nAnswer: ", "{q} Explain your reasoning step by step.", "{q} Show your work.",
              "Solve this word problem: {q}"]

# ---- competition-style problems --------------------------------------------------------------------
def comp(r: random.Random) -> str:
    a, b, c = r.randint(2, 9), r.randint(2, 19), r.randint(20, 90)
    p, q = r.sample([2, 3, 5, 7, 11, 13], 2)
    n = r.randint(5, 12)
    forms = [
        f"Solve for $x$: ${a}x + {b} = {c}$.",
        f"Find all real solutions of $x^2 - {p + q}x + {p * q} = 0$.",
        f"What is the greatest common divisor of ${a * p * 6}$ and ${a * q * 10}$?",
        f"What is the least common multiple of ${a + 3}$, ${b}$ and ${c // 3}$?",
        f"What is the remainder when ${a}^{{{n * 3}}}$ is divided by ${p + 4}$?",
        f"How many positive divisors does ${a * b * c}$ have?",
        f"Compute the sum of the arithmetic series ${b} + {b + a} + {b + 2 * a} + \\cdots + {b + (n + 10) * a}$.",
        f"A fair die is rolled {min(n, 6) - 2} times. What is the probability that at least one roll is a {r.randint(1, 6)}? Express your answer as a common fraction.",
        f"In how many ways can a committee of {min(a, 5)} people be chosen from a group of {c // 4 + 6} people?",
        f"Evaluate $f(g({a}))$ where $f(x) = {b}x - {a}$ and $g(x) = x^2 + {p}$.",
        f"Find the domain of the function $h(x) = \\frac{{\\sqrt{{x - {a}}}}}{{x - {b + a}}}$.",
        f"Simplify $\\frac{{{a * p * 12}}}{{{a * q * 18}}}$ and write it as a fraction in lowest terms.",
        f"Convert ${c + 100}_{{10}}$ to base {min(a, 8)}.",
        f"A right triangle has legs of length ${3 * a}$ and ${4 * a}$. What is the length of the altitude to the hypotenuse?",
        f"The sum of two numbers is ${c}$ and their difference is ${b if (c - b) % 2 == 0 else b + 1}$. What is their product?",
        f"Find the distance between the points $({a}, {-b})$ and $({-p}, {q + a})$. Express your answer in simplest radical form.",
        f"What is the slope of the line perpendicular to ${a}x - {b}y = {c}$?",
        f"If $\\log_{{{p}}} x = {min(n, 6)}$, what is $x$?",
        f"How many integers $n$ satisfy ${a} < n^2 < {c * 3}$?",
        f"The mean of {n} numbers is ${b}$. When one number is removed the mean becomes ${b - 1}$. What number was removed?",
        f"A circle has equation $x^2 + y^2 - {2 * a}x + {2 * p}y = {c}$. Find its center and radius.",
        f"Find the sum of all the positive two-digit integers that are divisible by ${a + 2}$.",
        f"What is the coefficient of $x^{{{min(n, 6) - 2}}}$ in the expansion of $(x + {min(a, 4)})^{{{min(n, 6)}}}$?",
        f"Let $a_1 = {a}$ and $a_{{k+1}} = {min(p, 3)}a_k - {b % 5 + 1}$. Find $a_{{{min(n, 7)}}}$.",
    ]
    body = r.choice(forms)
    style = r.randrange(3)
    if style == 0:
        return f"Problem: {body}\nSolution: Put your final answer in \\boxed{{}}.\n"
    if style == 1:
        return f"{body} Explain each step of your solution."
    return f"{body} Give a careful solution and state the final answer clearly."


# ---- Python function specs: (name, signature, docstring, example) -----------------------------------
SPECS = [
    ("second_largest", "nums: list[int]", "int | None", "Return the second largest distinct value, or None if there is none.", "second_largest([4, 1, 4, 3]) -> 3"),
    ("is_anagram", "a: str, b: str", "bool", "Return True if a and b contain the same letters, ignoring case and spaces.", "is_anagram('Dormitory', 'dirty room') -> True"),
    ("moving_average", "values: list[float], k: int", "list[float]", "Return the averages of every window of k consecutive values.", "moving_average([1, 2, 3, 4], 2) -> [1.5, 2.5, 3.5]"),
    ("to_roman", "n: int", "str", "Convert an integer from 1 to 3999 to a Roman numeral.", "to_roman(1994) -> 'MCMXCIV'"),
    ("from_roman", "s: str", "int", "Convert a Roman numeral to an integer.", "from_roman('XLII') -> 42"),
    ("longest_common_prefix", "words: list[str]", "str", "Return the longest prefix shared by all words.", "longest_common_prefix(['flower', 'flow', 'flight']) -> 'fl'"),
    ("balanced_brackets", "s: str", "bool", "Return True if every (, [ and { is closed in the right order.", "balanced_brackets('([]{})') -> True"),
    ("transpose", "m: list[list[int]]", "list[list[int]]", "Return the transpose of a rectangular matrix.", "transpose([[1, 2, 3], [4, 5, 6]]) -> [[1, 4], [2, 5], [3, 6]]"),
    ("primes_up_to", "n: int", "list[int]", "Return all primes <= n using the sieve of Eratosthenes.", "primes_up_to(20) -> [2, 3, 5, 7, 11, 13, 17, 19]"),
    ("digit_sum", "n: int", "int", "Return the sum of the decimal digits of n (n may be negative).", "digit_sum(-472) -> 13"),
    ("caesar", "text: str, shift: int", "str", "Shift each letter by shift places in the alphabet, keeping case; other characters stay.", "caesar('Abc, z!', 2) -> 'Cde, b!'"),
    ("group_by_length", "words: list[str]", "dict[int, list[str]]", "Group words by their length, keeping the input order inside each group.", "group_by_length(['a', 'bb', 'c']) -> {1: ['a', 'c'], 2: ['bb']}"),
    ("interleave", "a: list, b: list", "list", "Alternate elements of a and b; append what is left of the longer list.", "interleave([1, 2, 3], ['x']) -> [1, 'x', 2, 3]"),
    ("binary_search", "items: list[int], target: int", "int", "Return the index of target in the sorted list items, or -1.", "binary_search([1, 3, 5, 7], 5) -> 2"),
    ("count_islands", "grid: list[list[int]]", "int", "Count groups of 1s connected horizontally or vertically.", "count_islands([[1, 0], [0, 1]]) -> 2"),
    ("pascal_row", "n: int", "list[int]", "Return row n (0-based) of Pascal's triangle.", "pascal_row(4) -> [1, 4, 6, 4, 1]"),
    ("unique_in_order", "seq: list", "list", "Remove consecutive duplicates, keeping the first of each run.", "unique_in_order([1, 1, 2, 2, 1]) -> [1, 2, 1]"),
    ("title_case", "s: str, minor: set[str]", "str", "Capitalize each word except the words in minor, but always capitalize the first word.", "title_case('the lord of the rings', {'of', 'the'}) -> 'The Lord of the Rings'"),
    ("max_subarray", "nums: list[int]", "int", "Return the largest sum of a non-empty contiguous subarray (Kadane's algorithm).", "max_subarray([-2, 1, -3, 4, -1, 2, 1]) -> 6"),
    ("parse_duration", "s: str", "int", "Parse strings like '1h30m', '45s' or '2m5s' into a number of seconds.", "parse_duration('1h2m3s') -> 3723"),
    ("format_bytes", "n: int", "str", "Format a byte count with one decimal place and the largest fitting unit (B, KB, MB, GB).", "format_bytes(1536) -> '1.5 KB'"),
    ("spiral_order", "m: list[list[int]]", "list[int]", "Return the elements of the matrix in clockwise spiral order.", "spiral_order([[1, 2], [3, 4]]) -> [1, 2, 4, 3]"),
    ("gcd_list", "nums: list[int]", "int", "Return the greatest common divisor of all numbers in the list.", "gcd_list([12, 18, 30]) -> 6"),
    ("merge_intervals", "intervals: list[tuple[int, int]]", "list[tuple[int, int]]", "Merge overlapping closed intervals and return them sorted.", "merge_intervals([(1, 3), (2, 6), (8, 9)]) -> [(1, 6), (8, 9)]"),
    ("valid_ipv4", "s: str", "bool", "Return True if s is a dotted IPv4 address with four parts from 0 to 255 and no leading zeros.", "valid_ipv4('192.168.0.1') -> True"),
    ("word_wrap", "text: str, width: int", "list[str]", "Split text into lines of at most width characters without breaking words.", "word_wrap('the quick brown fox', 10) -> ['the quick', 'brown fox']"),
    ("histogram", "values: list[int]", "str", "Return one line per distinct value, sorted, with the value, a colon and a star per occurrence.", "histogram([2, 1, 2]) -> '1: *\\n2: **'"),
    ("nth_fibonacci", "n: int", "int", "Return the n-th Fibonacci number (F(0) = 0) in O(n) time and O(1) memory.", "nth_fibonacci(10) -> 55"),
    ("collatz_steps", "n: int", "int", "Return how many Collatz steps it takes for n to reach 1.", "collatz_steps(6) -> 8"),
    ("snake_to_camel", "name: str", "str", "Convert a snake_case identifier to camelCase.", "snake_to_camel('max_page_size') -> 'maxPageSize'"),
    ("camel_to_snake", "name: str", "str", "Convert a camelCase or PascalCase identifier to snake_case.", "camel_to_snake('HttpServerError') -> 'http_server_error'"),
    ("top_k_words", "text: str, k: int", "list[tuple[str, int]]", "Return the k most frequent lowercase words with their counts, ties broken alphabetically.", "top_k_words('b a b c a b', 2) -> [('b', 3), ('a', 2)]"),
    ("rotate_list", "items: list, k: int", "list", "Rotate the list right by k places; k may exceed the length or be negative.", "rotate_list([1, 2, 3, 4], 1) -> [4, 1, 2, 3]"),
    ("pairs_with_sum", "nums: list[int], target: int", "list[tuple[int, int]]", "Return the distinct pairs (a, b) with a <= b and a + b == target, sorted.", "pairs_with_sum([1, 5, 3, 3, 7], 6) -> [(1, 5), (3, 3)]"),
    ("is_palindrome_number", "n: int", "bool", "Return True if the decimal digits of n read the same backwards, without converting to a string.", "is_palindrome_number(12321) -> True"),
    ("flatten_dict", "d: dict, sep: str = '.'", "dict", "Flatten nested dictionaries, joining keys with sep.", "flatten_dict({'a': {'b': 1}, 'c': 2}) -> {'a.b': 1, 'c': 2}"),
    ("chunk_string", "s: str, n: int", "list[str]", "Split s into pieces of n characters; the last piece may be shorter.", "chunk_string('abcdefg', 3) -> ['abc', 'def', 'g']"),
    ("days_between", "a: str, b: str", "int", "Return the number of days between two ISO dates (YYYY-MM-DD), always non-negative.", "days_between('2024-02-27', '2024-03-01') -> 3"),
    ("median", "values: list[float]", "float", "Return the median of a non-empty list without modifying it.", "median([3, 1, 4, 2]) -> 2.5"),
    ("mode", "values: list[int]", "list[int]", "Return all values that occur most often, in ascending order.", "mode([1, 2, 2, 3, 3]) -> [2, 3]"),
    ("matrix_multiply", "a: list[list[float]], b: list[list[float]]", "list[list[float]]", "Multiply two matrices given as lists of rows; raise ValueError if the shapes do not match.", "matrix_multiply([[1, 2]], [[3], [4]]) -> [[11]]"),
    ("run_length_decode", "s: str", "str", "Decode strings like 'a3b2c1' into 'aaabbc'; counts may have several digits.", "run_length_decode('x12y1')[:3] -> 'xxx'"),
    ("count_vowels", "s: str", "dict[str, int]", "Count each vowel (a, e, i, o, u), ignoring case; every vowel appears in the result.", "count_vowels('Hello') -> {'a': 0, 'e': 1, 'i': 0, 'o': 1, 'u': 0}"),
    ("leap_years", "start: int, end: int", "list[int]", "Return the leap years in the inclusive range, using the Gregorian rules.", "leap_years(1896, 1904) -> [1896, 1904]"),
    ("temperature_table", "start: int, stop: int, step: int", "list[str]", "Return lines 'C -> F' converting Celsius to Fahrenheit with one decimal.", "temperature_table(0, 10, 10) -> ['0 -> 32.0', '10 -> 50.0']"),
    ("dedupe_emails", "emails: list[str]", "list[str]", "Remove duplicate email addresses, comparing case-insensitively, keeping the first spelling.", "dedupe_emails(['A@x.com', 'a@X.com', 'b@y.org']) -> ['A@x.com', 'b@y.org']"),
    ("staircase", "n: int", "str", "Return a right-aligned staircase of n lines made of '#' characters.", "staircase(3) -> '  #\\n ##\\n###'"),
    ("compress_ranges", "nums: list[int]", "str", "Describe sorted integers as ranges, like '1-3,5,7-8'.", "compress_ranges([1, 2, 3, 5, 7, 8]) -> '1-3,5,7-8'"),
    ("dot_product", "a: list[float], b: list[float]", "float", "Return the dot product of two vectors of equal length; raise ValueError otherwise.", "dot_product([1, 2], [3, 4]) -> 11"),
    ("find_duplicates", "items: list", "list", "Return the items that appear more than once, in order of their second appearance.", "find_duplicates([3, 1, 3, 2, 1]) -> [3, 1]"),
    ("hamming_distance", "a: str, b: str", "int", "Count positions where two equal-length strings differ.", "hamming_distance('karolin', 'kathrin') -> 3"),
    ("levenshtein", "a: str, b: str", "int", "Return the edit distance between a and b (insertions, deletions, substitutions).", "levenshtein('kitten', 'sitting') -> 3"),
    ("topological_order", "graph: dict[str, list[str]]", "list[str]", "Return an order of the nodes where every edge u -> v has u before v; raise ValueError on a cycle.", "topological_order({'a': ['b'], 'b': []}) -> ['a', 'b']"),
    ("shortest_path_length", "graph: dict[int, list[int]], start: int, goal: int", "int", "Return the number of edges on a shortest path using breadth-first search, or -1.", "shortest_path_length({1: [2], 2: [3], 3: []}, 1, 3) -> 2"),
    ("bank_balance", "transactions: list[str]", "float", "Apply lines like 'deposit 20.5' or 'withdraw 3' to a zero balance and return it.", "bank_balance(['deposit 10', 'withdraw 2.5']) -> 7.5"),
    ("sum_of_squares", "n: int", "int", "Return 1^2 + 2^2 + ... + n^2 using the closed formula.", "sum_of_squares(3) -> 14"),
    ("next_permutation", "nums: list[int]", "list[int]", "Return the next lexicographic permutation, or the smallest one if nums is the last.", "next_permutation([1, 2, 3]) -> [1, 3, 2]"),
    ("power_set", "items: list", "list[list]", "Return all subsets of items, ordered by size and then by position.", "power_set([1, 2]) -> [[], [1], [2], [1, 2]]"),
    ("count_paths", "rows: int, cols: int", "int", "Count monotone paths from the top-left to the bottom-right cell of a grid, moving right or down.", "count_paths(3, 3) -> 6"),
    ("mask_card", "number: str", "str", "Replace all but the last four digits of a card number with '*', keeping spaces.", "mask_card('1234 5678 9012 3456') -> '**** **** **** 3456'"),
    ("parse_csv_line", "line: str", "list[str]", "Split one CSV line on commas, honouring double-quoted fields that contain commas.", "parse_csv_line('a,\"b,c\",d') -> ['a', 'b,c', 'd']"),
    ("weekday_name", "date: str", "str", "Return the English weekday name of an ISO date.", "weekday_name('2024-01-01') -> 'Monday'"),
    ("clamp_all", "values: list[float], low: float, high: float", "list[float]", "Clamp every value into [low, high].", "clamp_all([-1, 5, 12], 0, 10) -> [0, 5, 10]"),
    ("majority_element", "nums: list[int]", "int | None", "Return the element occurring more than len(nums) // 2 times (Boyer-Moore vote), else None.", "majority_element([2, 2, 1, 2]) -> 2"),
    ("longest_increasing_run", "nums: list[int]", "int", "Return the length of the longest strictly increasing contiguous run.", "longest_increasing_run([1, 2, 2, 3, 4, 1]) -> 3"),
    ("celsius_stats", "readings: dict[str, list[float]]", "dict[str, tuple[float, float]]", "Return the (min, max) reading per city.", "celsius_stats({'Oslo': [1, -3]}) -> {'Oslo': (-3, 1)}"),
    ("invert_dict", "d: dict", "dict", "Map each value to the list of keys that had it.", "invert_dict({'a': 1, 'b': 1, 'c': 2}) -> {1: ['a', 'b'], 2: ['c']}"),
    ("zigzag", "s: str, rows: int", "str", "Write s in a zigzag over the given number of rows and read it line by line.", "zigzag('PAYPALISHIRING', 3) -> 'PAHNAPLSIIGYIR'"),
    ("armstrong_numbers", "limit: int", "list[int]", "Return numbers below limit that equal the sum of their digits each raised to the number of digits.", "armstrong_numbers(200) -> [1, 2, 3, 4, 5, 6, 7, 8, 9, 153]"),
    ("bits_to_int", "bits: list[int]", "int", "Interpret a list of 0/1 values (most significant first) as an unsigned integer.", "bits_to_int([1, 0, 1]) -> 5"),
    ("safe_divide", "a: float, b: float, default: float = 0.0", "float", "Return a / b, or default when b is zero.", "safe_divide(1, 0, -1) -> -1"),
    ("nested_sum", "data", "float", "Sum all numbers in arbitrarily nested lists and tuples, ignoring other types.", "nested_sum([1, (2, [3.5]), 'x']) -> 6.5"),
]
CODE_FORMS = [
    'Complete the following Python function.\n\ndef {name}({sig}) -> {ret}:\n    """{doc}\n    Example: {ex}\n    """\n',
    "Write a Python function `{name}({sig})` that does the following: {doc} For example, {ex}.",
    "Implement `{name}` in Python. {doc} Add type hints, a docstring, and a few assert-based tests, e.g. {ex}.",
    "Write `{name}({sig}) -> {ret}` in Python and explain its time complexity. {doc}",
]
CODE_TASKS = [
    "Write a Python class `{cls}` with methods to add, remove and list {thing}, storing them in a dictionary keyed by name. Include a short usage example.",
    "Write a Python script that reads a CSV file of {thing} from the command line (use argparse and the csv module) and prints the three rows with the largest value in a chosen column.",
    "Write a Python dataclass for {thing} with validation in __post_init__, and a function that sorts a list of them by two fields.",
    "Explain what this Python code does and suggest one improvement:\n\n```python\ndef f(xs):\n    out = []\n    for i in range(len(xs)):\n        if xs[i] not in out:\n            out.append(xs[i])\n    return out\n```",
    "Write a Python generator that yields {thing} records from a large text file one line at a time, skipping blank lines and comments starting with '#'.",
    "Write unit tests with pytest for a function `parse_price(s: str) -> float` that accepts strings like '$1,299.99' and '12 USD'.",
    "Write a small Python LRU cache class with get and put methods in O(1) time, without using functools.",
    "Show how to use Python's `collections.Counter` to find the most common {thing} in a list, with a short example.",
    "Write a SQL query that returns, for each {thing} category, the number of items and the average price, sorted by the count descending. Explain each clause.",
    "Write a Python function that retries a callable up to n times with exponential backoff, and explain when backoff is useful.",
]
THINGS = ["books", "students", "recipes", "songs", "orders", "tasks", "movies", "sensors", "employees", "products", "flights", "invoices"]

# ---- writing / explaining / advice -----------------------------------------------------------------
TOPICS = ["composting at home", "learning a second language as an adult", "the water cycle", "how vaccines train the immune system",
          "saving for retirement in your twenties", "the causes of the French Revolution", "how a bill becomes a law", "photosynthesis",
          "remote work", "urban cycling", "the history of the printing press", "how credit scores work", "plate tectonics",
          "public libraries", "sleep hygiene", "electric cars", "the basics of chess openings", "beekeeping", "volcanoes",
          "how search engines rank pages", "minimalism", "the Silk Road", "ocean tides", "starting a vegetable garden",
          "the invention of the telephone", "how inflation affects savings", "black holes", "team sports for children",
          "renewable energy", "the Roman aqueducts", "how airplanes stay in the air", "budget travel", "board games",
          "the human digestive system", "machine learning", "recycling plastics", "the Great Barrier Reef", "public speaking",
          "how a refrigerator works", "time management for students", "the Apollo 11 mission", "coffee cultivation",
          "microplastics", "open-source software", "the history of jazz", "earthquakes", "first aid for minor burns",
          "how bridges carry loads", "bird migration", "the stock market", "meditation", "antibiotic resistance",
          "the metric system", "volunteering", "3D printing", "the life cycle of stars", "healthy school lunches"]
WRITE_FORMS = ["Write a short blog post about {t}.", "Give me five practical tips about {t}, with one sentence of explanation each.",
               "Explain {t} to a ten-year-old.", "What are the main advantages and disadvantages of {t}?",
               "Write a persuasive paragraph for a school newsletter about {t}.", "Summarize the key facts about {t} in a bulleted list.",
               "Write a short dialogue between a teacher and a student about {t}.", "Describe {t} in three paragraphs for a general audience.",
               "Write a haiku and then a limerick about {t}.", "I am giving a five-minute talk on {t}. Outline it for me.",
               "What are three common misconceptions about {t}, and what is actually true?", "Write a short story of about 150 words that involves {t}.",
               "Compare {t} with a related idea of your choice and explain how they differ.", "Create a quiz of five multiple-choice questions about {t}, with answers."]
PEOPLE = ["my landlord", "a new colleague", "my child's teacher", "a hiring manager", "my neighbour", "a customer", "my manager", "a conference organizer"]
EMAIL = ["Draft a polite email to {p} asking to reschedule a meeting about {t}.", "Write a short, friendly message to {p} thanking them for their help with {t}.",
         "Write an email to {p} explaining a delay and proposing a new deadline for a project on {t}."]


BOILERPLATE = ["Explain your reasoning step by step.", "Show your work.", "Explain each step of your solution.",
               "Give a careful solution and state the final answer clearly.", "Solution: Put your final answer in \\boxed{}."]


def shingles(text: str, n: int = 8, strip: bool = False) -> set[tuple[str, ...]]:
    """8-word sequences of ``text``; ``strip`` drops the answer-format phrases first (for the
    check against the hand-written set, whose prompts end with the same phrases)."""
    for b in BOILERPLATE if strip else ():
        text = text.replace(b, " | ")
    w = re.findall(r"[a-z0-9|]+", text.lower())
    return {tuple(w[i:i + n]) for i in range(len(w) - n + 1)}


def eval_texts(eval_dir: Path) -> list[str]:
    out = []
    for f in sorted(eval_dir.glob("*.jsonl")):
        for line in f.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                out += [m["content"] for m in r.get("messages", [])] + list(r.get("turns", []))
    return out


def make(seed: int) -> list[dict]:
    r = random.Random(seed)
    rows: list[tuple[str, str]] = []
    for i in range(200):
        a, b = r.sample(NAMES, 2)
        item, price = r.choice(ITEMS)
        n1, n2, n3 = r.randint(6, 60), r.randint(2, 25), r.choice(range(120, 2400, 20))
        k, w, d = r.randint(2, 6), r.randint(2, 9), r.randint(5, 30) * 10
        v = r.choice([40, 60, 75, 80, 90, 120])
        q = WORD[i % len(WORD)].format(a=a, b=b, item=item, n1=n1, n2=n2, n3=n3, k=k, w=w, w2=k * w, d=d, v=v,
                                       price=f"{price:.2f}", single=f"{price * 1.3:.2f}", bill=r.choice([20, 50, 100]),
                                       p=r.choice([10, 15, 20, 25, 30, 40, 60, 75]), h1=r.randint(6, 20), m1=r.choice(range(0, 60, 5)),
                                       wage=r.choice([12, 15, 18, 22, 27]), fuel=f"{r.uniform(1.3, 2.1):.2f}")
        rows.append(("math", r.choice(WORD_FORMS).format(q=q)))
    for _ in range(150):
        rows.append(("math", comp(r)))
    for i, (name, sig, ret, doc, ex) in enumerate(SPECS):
        for form in r.sample(CODE_FORMS, 2):
            rows.append(("code", form.format(name=name, sig=sig, ret=ret, doc=doc, ex=ex)))
    for task in CODE_TASKS:
        for thing in r.sample(THINGS, 3):
            cls = thing.title().rstrip("s") + "Registry"
            rows.append(("code", task.format(thing=thing, cls=cls)))
    forms = [(f, t) for f in WRITE_FORMS for t in TOPICS]
    for f, t in r.sample(forms, 170):
        rows.append(("explain" if f.startswith(("Explain", "Describe", "Summarize", "What", "Compare")) else "chat", f.format(t=t)))
    for _ in range(24):
        rows.append(("chat", r.choice(EMAIL).format(p=r.choice(PEOPLE), t=r.choice(TOPICS))))
    seen, out = set(), []
    for kind, text in rows:
        if text in seen:
            continue
        seen.add(text)
        out.append({"kind": kind, "messages": [{"role": "user", "content": text}], "split": "train"})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--eval-dir", default=str(ROOT.parent / "shared" / "eval"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    banned, own = set(), set()
    for t in eval_texts(Path(args.eval_dir)):
        banned |= shingles(t)
    for line in (ASSETS / "train_prompts.jsonl").read_text().splitlines():
        own |= {s for m in json.loads(line)["messages"] for s in shingles(m["content"], strip=True)}
    rows = make(args.seed)
    kept = [p for p in rows if not (shingles(p["messages"][0]["content"]) & banned)
            and not (shingles(p["messages"][0]["content"], strip=True) & own)]
    kept = [{"kind": p["kind"], "messages": p["messages"], "id": f"tt_{i:04d}", "split": "train"}
            for i, p in enumerate(kept)]
    Path(args.out).write_text("".join(json.dumps(p) + "\n" for p in kept))
    kinds = {}
    for p in kept:
        kinds[p["kind"]] = kinds.get(p["kind"], 0) + 1
    print(f"{len(kept)} prompts ({len(rows) - len(kept)} dropped for overlap) -> {args.out}: {kinds}")


if __name__ == "__main__":
    main()
