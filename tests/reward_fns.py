"""User reward functions for the job tests (imported by reward worker processes as `reward_fns:NAME`)."""


def says_mat(prompt, response, reference):
    """1 when the response contains the word "mat"."""
    return 1.0 if "mat" in response.split() else 0.0


def sleeps_forever(prompt, response, reference):
    """Never returns."""
    import time

    while True:
        time.sleep(60)


def always_raises(prompt, response, reference):
    """Raises, after printing lines to its standard output and error."""
    import sys

    from env_cases import NOISE

    for k in range(NOISE):
        print(f"reward noise {k} on stdout")
        print(f"reward noise {k} on stderr", file=sys.stderr)
    raise ValueError(f"cannot score {response!r}")


def passes_its_tests(prompt, response, reference, record):
    """A reward that needs more of the record than its reference: the share of the record's test cases the
    response's text contains."""
    tests = record["tests"]
    return sum(t in response for t in tests) / len(tests)

