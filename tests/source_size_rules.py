#!/usr/bin/env python3
"""The project's size rules for its own sources: no C++ or CUDA
file outside tests/ and benches/ over 900 lines, and no function body there
over 150 lines. Prints every file or function over, and exits 1 if any is.

Usage: source_size_rules.py REPO_ROOT [--self-test]

Function bodies are found by matching braces with comments, string and
character literals and preprocessor lines blanked out: a `{` opens a function
body when the statement before it ends in `)` (with qualifiers such as
`const`, `override`, `noexcept` or a trailing return type after it) or is a
constructor's initializer list, outside any other function; namespace, class,
struct, union and enum braces are scopes that may hold functions. Lambdas and
blocks inside a function count toward that function.
"""
import os
import re
import sys

MAX_FILE_LINES = 900
MAX_FUNCTION_LINES = 150
EXTENSIONS = (".cpp", ".h", ".cu", ".cuh")
SKIPPED_TOP = {"tests", "benches", "build", ".git", "shared", "third_party"}


def blank_noncode(text):
    """The text with comments, literals and preprocessor lines replaced by
    spaces (line breaks kept), so braces in them do not count."""
    out = []
    i, n = 0, len(text)
    at_line_start = True
    while i < n:
        c = text[i]
        if at_line_start and c == "#":
            # A preprocessor line, with its continuations.
            while i < n and text[i] != "\n":
                if text[i] == "\\" and i + 1 < n and text[i + 1] == "\n":
                    out.append(" \n")
                    i += 2
                    continue
                out.append(" ")
                i += 1
            continue
        if c == "/" and text.startswith("//", i):
            while i < n and text[i] != "\n":
                out.append(" ")
                i += 1
            continue
        if c == "/" and text.startswith("/*", i):
            end = text.find("*/", i + 2)
            end = n if end < 0 else end + 2
            out.append(re.sub(r"[^\n]", " ", text[i:end]))
            i = end
            continue
        if c == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]{0,16})\(', text[i:])
            if m:
                close = ")" + m.group(1) + '"'
                end = text.find(close, i + m.end())
                end = n if end < 0 else end + len(close)
                out.append(re.sub(r"[^\n]", " ", text[i:end]))
                i = end
                continue
        if c in "\"'":
            # A digit separator (1'000'000) is not a character literal.
            if c == "'" and i > 0 and text[i - 1].isalnum() and i + 1 < n and text[i + 1].isalnum():
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(" " * (j - i))
            i = j
            continue
        out.append(c)
        at_line_start = c == "\n" or (at_line_start and c in " \t")
        i += 1
    return "".join(out)


SCOPE = re.compile(r"\b(namespace|class|struct|union|enum)\b")
FUNCTION_TAIL = re.compile(
    r"\)\s*(const|override|final|noexcept(\s*\([^)]*\))?|mutable|&|&&|->\s*[\w:<>,\s*&]+|\s)*$")


def opens_function(head):
    """Whether a `{` after this statement head starts a function body."""
    head = head.strip()
    if not head or head.endswith("="):
        return False
    if FUNCTION_TAIL.search(head):
        return "(" in head and not re.search(r"\b(if|for|while|switch|catch)\s*\(", head)
    # A constructor's initializer list ends in a member's (...) or {...}.
    return bool(re.search(r"\)\s*:\s*\w", head)) and head.endswith(("}", ")"))


def long_functions(text):
    """(first line, lines in the body) of each function body over the limit."""
    code = blank_noncode(text)
    found = []
    stack = []  # per open brace: ("scope" | "function" | "block", line)
    head_start = 0
    line = 1
    for i, c in enumerate(code):
        if c == "\n":
            line += 1
        elif c in ";":
            head_start = i + 1
        elif c == "{":
            head = code[head_start:i]
            in_function = any(kind == "function" for kind, _ in stack)
            if in_function:
                kind = "block"
            elif SCOPE.search(head) and "(" not in head.split("{")[-1].split(":")[0]:
                kind = "scope"
            elif opens_function(head):
                kind = "function"
            elif re.search(r"\)\s*:\s*\w", head) and re.search(r"\w\s*$", head):
                kind = "init"  # a member's brace initializer in a constructor's list
            elif head.strip().startswith("extern"):
                kind = "scope"
            else:
                kind = "block"
            stack.append((kind, line))
            if kind != "init":
                head_start = i + 1
        elif c == "}":
            if stack:
                kind, start = stack.pop()
                if kind == "function" and line - start - 1 > MAX_FUNCTION_LINES:
                    found.append((start, line - start - 1))
                if kind == "init":
                    continue  # the initializer list goes on
            head_start = i + 1
    return found


def sources(root):
    for top in sorted(os.listdir(root)):
        if top in SKIPPED_TOP or top.startswith(".") or top.startswith("build"):
            continue
        path = os.path.join(root, top)
        if os.path.isfile(path):
            if path.endswith(EXTENSIONS):
                yield path
            continue
        for directory, subdirs, files in os.walk(path):
            subdirs[:] = sorted(d for d in subdirs if not d.startswith((".", "build")))
            for name in sorted(files):
                if name.endswith(EXTENSIONS):
                    yield os.path.join(directory, name)


def self_test():
    sample = '''namespace a {
struct S {
  int f() const {
    return 1;
  }
};
int g(int x) {
  auto h = [&](int y) {
    return y;
  };
  if (x) {
    const char* s = "{";
  }
  return h(x);
}
S::S() : a_(1), b_{2} {
  c_ = 3;
}
}  // namespace a
'''
    code = blank_noncode(sample)
    assert code.count("{") == sample.count("{") - 1, "a brace in a string counts"
    global MAX_FUNCTION_LINES
    kept = MAX_FUNCTION_LINES
    MAX_FUNCTION_LINES = 0
    found = long_functions(sample)
    MAX_FUNCTION_LINES = kept
    assert [start for start, _ in found] == [3, 7, 16], found
    assert dict(found)[7] == 7, found
    print("self-test passed")


def main():
    if len(sys.argv) < 2:
        print(__doc__)
        return 2
    if "--self-test" in sys.argv:
        self_test()
    root = sys.argv[1]
    over = 0
    checked = 0
    for path in sources(root):
        checked += 1
        with open(path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        rel = os.path.relpath(path, root)
        lines = text.count("\n")
        if lines > MAX_FILE_LINES:
            print(f"{rel}: {lines} lines, over {MAX_FILE_LINES}: split it by concern")
            over += 1
        for start, length in long_functions(text):
            print(f"{rel}:{start}: a function body of {length} lines, over {MAX_FUNCTION_LINES}")
            over += 1
    print(f"{checked} source files checked, {over} over the size rules")
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
