"""Environments (`megatron_rl.environments`): the `env` section, the worker pool against environments that behave and
that hang, crash, raise or return ill-typed values (tests/env_cases.py), replay against a live instance, and the
built-in guessing game."""

import logging
import math
import time

import pytest

from env_cases import ILL_TYPED, Counter
from megatron_rl.environments import (MAX_FAILING_BATCHES, EnvironmentFailureError, EnvironmentPool,
                                      EnvironmentSpecError, EnvSettings, GuessNumber, Turn, binary_search_transcript,
                                      first_integer, guess_records)

TIMEOUT_S = 0.5


def live_turns(cls, record, seed, responses):
    """The Turns of an episode played in this process on one instance: the reference a pool's answers must match."""
    env = cls(record, seed)
    turns = [Turn(env.reset())]
    for response in responses:
        message, reward, done = env.step(response)
        turns.append(Turn(message, reward, done))
    return turns


def same(a: Turn, b: Turn) -> bool:
    return (a.message, a.reward, a.done, a.error) == (b.message, b.reward, b.done, b.error)


# ---- the `env` section --------------------------------------------------------------------------------------------


def test_settings_defaults_and_ranges():
    s = EnvSettings()
    assert (s.cls, s.max_turns, s.max_tokens, s.timeout_s, s.num_workers) == (None, 4, 512, 10.0, 2)
    assert s.problems() == [] and s.problems_importing() == []
    with pytest.raises(ValueError) as e:
        EnvSettings(cls="env_cases.Counter", max_turns=0, timeout_s=0.0)
    assert str(e.value) == ("env.max_turns=0 must be >= 1 (the most model turns in an episode); env.timeout_s=0.0 "
                            "must be > 0; env.cls='env_cases.Counter' must look like 'module:Class' (or "
                            "'path/file.py:Class')")


@pytest.mark.parametrize("spec,problem", [
    ("env_cases:Counter", None),
    ("no_such_module_xyz:Env", "no module named 'no_such_module_xyz'"),
    ("env_cases:Nope", "module 'env_cases' has no attribute 'Nope'"),
    ("env_cases:NoStep", "class NoStep has no callable step"),
    ("env_cases:StepTakesNoReply", "StepTakesNoReply.step(reply) does not match its signature (self) (the "
                                   "interface: environments.pool.Environment)"),
    ("env_cases:not_a_class", "'not_a_class' is a function, not a class"),
    ("env_cases:ILL_TYPED", "'ILL_TYPED' is not callable"),
])
def test_settings_import_the_class_and_say_what_is_wrong_in_one_line(spec, problem):
    found = EnvSettings(cls=spec).problems_importing()
    assert found == ([] if problem is None else [f"env.cls={spec!r}: {problem}"])


# ---- the pool -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec,line", [
    ("env_cases", "env 'env_cases' must look like 'module:Class' (or 'path/file.py:Class')"),
    ("no_such_module_xyz:Env", "env 'no_such_module_xyz:Env': no module named 'no_such_module_xyz'"),
    ("env_cases:NoStep", "env 'env_cases:NoStep': class NoStep has no callable step"),
    ("/nonexistent/env.py:Env", "env '/nonexistent/env.py:Env': file /nonexistent/env.py not found"),
])
def test_a_bad_spec_fails_at_construction_in_one_line(spec, line):
    with pytest.raises(EnvironmentSpecError) as e:
        EnvironmentPool(spec, num_workers=1, timeout_s=TIMEOUT_S)
    assert str(e.value) == line


def test_episodes_step_once_per_call_and_a_replay_matches_a_live_instance():
    record, seed, replies = {"prompt": "count:", "turns": 3}, 5, ["ab", "c", "def"]
    live = live_turns(Counter, record, seed, replies)
    with EnvironmentPool("env_cases:Counter", num_workers=1, timeout_s=TIMEOUT_S) as pool:
        turns = pool.first([(record, seed)])
        for k in range(1, len(replies) + 1):
            turns += pool.step([(record, seed, replies[:k])])
        assert all(same(a, b) for a, b in zip(turns, live, strict=True))
        assert turns[0].message == {"role": "user", "content": "count:"} and not turns[0].done
        assert turns[1].message == {"role": "tool", "content": "turn 1: ab"} and turns[1].reward == 7.0
        assert turns[-1].message is None and turns[-1].done and turns[-1].reward == 8.0
        assert pool.stats["replayed_steps"] == 0  # each call found its episode live in the one worker
        # An episode the worker has not seen (a resumed run, a replaced worker) is rebuilt by replay: same answers.
        other = {"prompt": "again:", "turns": 4}
        assert same(pool.step([(other, 1, replies)])[0], live_turns(Counter, other, 1, replies)[-1])
        assert pool.stats["replayed_steps"] == 2 and pool.stats["calls"] == 5 and pool.stats["errors"] == 0
        # Responses after the end: the replay says so (an environment that is not deterministic looks the same).
        assert pool.step([({"prompt": "p", "turns": 1}, 0, ["a", "b"])])[0].error == (
            "env env_cases:Counter.step ended the episode at response 1 of 2 when replayed: responses after the end, "
            "or an environment that is not deterministic given (record, seed, responses)")
        with pytest.raises(ValueError, match="at least one"):
            pool.step([(record, seed, [])])


def test_each_call_goes_to_the_worker_that_holds_its_episode():
    """Two workers, two episodes: the resets land one on each worker; the steps then come in the other order, and
    each still finds its episode live where it was left (dispatched in order, as before routing, both replay)."""
    records = [({"prompt": "a:", "turns": 3}, 0), ({"prompt": "b:", "turns": 3}, 1)]
    with EnvironmentPool("env_cases:Counter", num_workers=2, timeout_s=TIMEOUT_S) as pool:
        pool.first(records)
        replies = [["x"], ["x", "yy"], ["x", "yy", "zzz"]]
        for k, rs in enumerate(replies):
            order = records[::-1] if k % 2 == 0 else records
            turns = pool.step([(record, seed, rs) for record, seed in order])
            assert all(same(t, live_turns(Counter, record, seed, rs)[-1]) for t, (record, seed) in zip(turns, order))
        assert pool.stats["replayed_steps"] == 0 and pool.stats["errors"] == 0
        assert not pool._where  # both episodes are over: nothing kept for them
        # Its processes (and its workers' log lines) name the class, not the runner the workers import.
        assert {w.process.name for w in pool._pool._workers} == {"worker[env 'env_cases:Counter']"}


class _W:
    def __init__(self, state):
        self.state = state


@pytest.mark.parametrize("prefer,workers,taker,expected", [
    ([1, 0, None], ["idle", "idle"], 0, 1),  # its own call first
    ([1, None], ["idle", "busy"], 0, 1),  # then one that prefers no worker
    ([1], ["idle", "busy"], 0, None),  # a busy worker's only call waits for it
    ([1, 1, 1], ["idle", "busy"], 0, 2),  # two or more waiting: the newest is stolen
    ([1], ["idle", "starting"], 0, 0),  # its worker restarting: what it held is gone, run it now
    ([1], ["idle", None], 0, 0),  # its worker could not be restarted
    ([5, None], ["idle", "idle"], 1, 0),  # a preference for no such worker is none
])
def test_which_call_an_idle_worker_takes(prefer, workers, taker, expected):
    from megatron_rl.sandbox.pool import _Queue

    queue = _Queue(prefer, num_workers=len(workers))
    assert queue.take(taker, [w if w is None else _W(w) for w in workers]) == expected


def test_a_hung_crashing_and_raising_environment_each_fail_one_episode_in_one_line(caplog):
    caplog.set_level(logging.WARNING)
    record = {"prompt": "count:", "turns": 5}
    replies = ["ok", "hang", "ok", "exit", "raise", "fine"]
    with EnvironmentPool("env_cases:Misbehaves", num_workers=2, timeout_s=TIMEOUT_S) as pool:
        t0 = time.monotonic()
        turns = pool.step([(record, seed, ["a", reply]) for seed, reply in enumerate(replies)])
        assert time.monotonic() - t0 < 10
        assert [t.error for t in turns] == [
            None, "env env_cases:Misbehaves.step: timed out after 0.5 s", None,
            "env env_cases:Misbehaves.step: worker died (exit code 3)",
            "env env_cases:Misbehaves.step raised RuntimeError: boom", None]
        for seed, (reply, turn) in enumerate(zip(replies, turns)):
            if turn.error is None:  # the other episodes of the batch are unaffected
                assert same(turn, live_turns(Counter, record, seed, ["a", reply])[-1])
            else:
                assert turn.done and turn.reward == 0.0 and turn.message is None
        assert pool.failures == 3
        stats = pool.stats
        assert (stats["calls"], stats["errors"], stats["timeouts"], stats["crashes"], stats["restarts"]) == \
            (6, 3, 1, 1, 2)
        pool.end_batch([t.error for t in turns if t.error], len(turns))
        assert pool.failing_batches == 0  # half the batch is not more than half
        assert "failed on 3 of 6 episodes" in caplog.text and "second line" not in caplog.text
        # The pool was repaired: the next batch works, on both workers.
        again = pool.step([(record, seed, ["a", "ok", "b"]) for seed in range(4)])
        assert all(same(t, live_turns(Counter, record, seed, ["a", "ok", "b"])[-1]) for seed, t in enumerate(again))
        assert pool.failures == 0 and pool.stats["errors"] == 3


def test_ill_typed_results_fail_their_episode_in_one_line_naming_class_method_and_problem():
    where = "env env_cases:Misbehaves.step returned"
    expected = {
        "list": f"{where} a list, expected (message, reward, done)",
        "pair": f"{where} a tuple of 2, expected (message, reward, done)",
        "nothing": f"{where} None, expected (message, reward, done)",
        "text reward": f"{where} reward '1' (a str), expected a finite number",
        "nan reward": f"{where} reward nan (a float), expected a finite number",
        "bool reward": f"{where} reward True (a bool), expected a finite number",
        "int done": f"{where} done=1 (an int), expected a bool",
        "int message": f"{where} message 3 (an int), expected a str or a {{'role', 'content'}} dict of strings",
        "half dict": f"{where} message {{'role': 'tool'}}, expected a str or a {{'role', 'content'}} dict of strings",
        "silent": f"{where} message None with done=False, expected the next message",
    }
    assert set(expected) == set(ILL_TYPED)
    record = {"prompt": "count:"}
    with EnvironmentPool("env_cases:Misbehaves", num_workers=2, timeout_s=TIMEOUT_S) as pool:
        turns = pool.step([(record, 0, [reply]) for reply in [*expected, "fine"]])
        assert [t.error for t in turns] == [*expected.values(), None]
        assert same(turns[-1], live_turns(Counter, record, 0, ["fine"])[-1])
        assert pool.stats["errors"] == len(expected) and pool.stats["restarts"] == 0


def test_failures_to_build_or_reset_an_environment_fail_their_episode_in_one_line():
    records = [{"prompt": "p", "init": "raise"}, {"prompt": "p", "reset": "raise"}, {"prompt": "p", "reset": 5},
               {"prompt": "p", "reset": {"role": "user", "content": None}}, {"prompt": "p", "reset": "hang"},
               {"prompt": "p"}]
    expected = "expected a str or a {'role', 'content'} dict of strings"
    with EnvironmentPool("env_cases:Misbehaves", num_workers=2, timeout_s=TIMEOUT_S) as pool:
        turns = pool.first([(r, 0) for r in records])
        assert [t.error for t in turns] == [
            "env env_cases:Misbehaves(record, seed) raised KeyError: 'no such level'",
            "env env_cases:Misbehaves.reset raised RuntimeError: boom",
            f"env env_cases:Misbehaves.reset returned 5 (an int), {expected}",
            f"env env_cases:Misbehaves.reset returned {{'role': 'user', 'content': None}}, {expected}",
            "env env_cases:Misbehaves.reset: timed out after 0.5 s",
            None]
        assert turns[-1].message == {"role": "user", "content": "p"} and turns[-1].reward == 0.0
        # A step replays the reset, which fails the same way.
        assert pool.step([(records[0], 0, ["a"])])[0].error == turns[0].error


def test_an_environment_failing_on_most_episodes_stops_after_three_batches_in_a_row(tmp_path):
    """A batch is what the caller says it is (`end_batch`: a rollout batch's resets and steps together), not one
    call: an episode that fails in its third turn counts in the batch it belongs to."""
    record = {"prompt": "count:"}
    log = tmp_path / "workers.log"
    with EnvironmentPool("env_cases:Misbehaves", num_workers=2, timeout_s=TIMEOUT_S, log_path=str(log)) as pool:
        mostly_bad = [(record, 0, [r]) for r in ("raise", "raise", "ok")]

        def batch(calls):
            turns = pool.step(calls)
            pool.end_batch([t.error for t in turns if t.error is not None], len(turns))
            return turns

        assert [t.error is None for t in batch(mostly_bad)] == [False, False, True]
        assert pool.failures == 2 and pool.failing_batches == 1
        batch([(record, 0, [r]) for r in ("raise", "ok")])  # half is not more than half
        assert pool.failures == 1 and pool.failing_batches == 0
        for _ in range(5):  # calls without a batch's end count nothing
            pool.step(mostly_bad)
        assert pool.failing_batches == 0
        for _ in range(MAX_FAILING_BATCHES - 1):
            batch(mostly_bad)
        with pytest.raises(EnvironmentFailureError) as e:
            batch(mostly_bad)
    assert str(e.value) == (
        "env 'env_cases:Misbehaves' failed on 2 of 3 episodes, and on more than half in each of the last 3 batches "
        "(last error: env env_cases:Misbehaves.step raised RuntimeError: boom); stopping: fix the environment "
        f"(tracebacks and output: {log}), or raise env.timeout_s / env.num_workers")
    # The tracebacks are in the log, whole (the line the pool got is the first line of the message only).
    text = log.read_text()
    raised = "env env_cases:Misbehaves.step raised:\nTraceback (most recent call last):"
    assert text.count(raised) == 2 + 1 + 2 * 5 + 2 * MAX_FAILING_BATCHES
    assert "RuntimeError: boom\nsecond line" in text and "in misbehave" in text


def test_an_environment_from_a_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text("class Echo:\n    def __init__(self, record, seed):\n        self.record = record\n"
                    "    def reset(self):\n        return self.record['prompt']\n"
                    "    def step(self, response):\n        return response.upper(), 0.5, False\n")
    with EnvironmentPool(f"{path}:Echo", num_workers=1, timeout_s=5.0) as pool:
        turn = pool.step([({"prompt": "p"}, 0, ["a", "b"])])[0]
    assert same(turn, Turn("B", 0.5, False)) and 0 < turn.seconds < 5


def test_turn_messages():
    assert Turn("hi").message == {"role": "user", "content": "hi"}
    assert Turn({"role": "tool", "content": "3"}, 1.0, True).message == {"role": "tool", "content": "3"}
    assert Turn.failed("boom\nat line 3").error == "boom"
    with pytest.raises(ValueError, match="must end the episode"):
        Turn(None)
    with pytest.raises(ValueError, match="expected a str"):
        Turn({"role": "tool", "content": "x", "name": "calc"})


# ---- the guessing game ---------------------------------------------------------------------------------------------


def test_guess_number_answers_higher_lower_and_a_number():
    env = GuessNumber({"prompt": "guess 1-16:", "reference": "11"}, 0)
    assert env.reset() == "guess 1-16:"
    assert env.step("8") == ("higher", 0.0, False)
    assert env.step(" 12\n5") == ("lower", 0.0, False)
    assert env.step("hmm") == ("a number", 0.0, False)
    assert env.step("is it 11?") == (None, 1.0, True)
    assert first_integer("x-3y") == -3 and first_integer("") is None


@pytest.mark.parametrize("low,high", [(1, 16), (1, 1), (0, 100)])
def test_binary_search_finds_every_number_within_the_bound(low, high):
    bound = math.ceil(math.log2(high - low + 1)) + 1
    for hidden in range(low, high + 1):
        transcript = binary_search_transcript(hidden, low, high)
        assert 1 <= len(transcript) <= bound
        assert int(transcript[-1][0]) == hidden and transcript[-1][1] is None
        for reply, message in transcript[:-1]:  # every hint is true of the hidden number
            assert message == ("higher" if int(reply) < hidden else "lower")


def test_guess_records_are_deterministic_and_in_range():
    records = guess_records(64, seed=3)
    assert records == guess_records(64, seed=3) and records != guess_records(64, seed=4)
    assert {r["prompt"] for r in records} == {"guess 1-16:"}
    assert {int(r["reference"]) for r in records} <= set(range(1, 17))
    assert len({r["id"] for r in records}) == 64


def test_the_guessing_game_in_the_pool_plays_an_optimal_transcript():
    record = guess_records(1, seed=0)[0]
    transcript = binary_search_transcript(int(record["reference"]), 1, 16)
    replies = [reply for reply, _ in transcript]
    with EnvironmentPool("megatron_rl.environments.guess:GuessNumber", num_workers=1, timeout_s=5.0) as pool:
        assert pool.first([(record, 0)])[0].message == {"role": "user", "content": "guess 1-16:"}
        turns = [pool.step([(record, 0, replies[:k])])[0] for k in range(1, len(replies) + 1)]
    assert [t.message and t.message["content"] for t in turns] == [message for _, message in transcript]
    assert [t.reward for t in turns] == [0.0] * (len(turns) - 1) + [1.0] and turns[-1].done


# ---- the calculator (tool use) ------------------------------------------------------------------------------------


@pytest.mark.parametrize("expression, value", [
    ("45+40+8", 93), (" 3 * (4 - 6) ", -6), ("-7+2", -5), ("9/3", 3), ("7/2", __import__("fractions").Fraction(7, 2)),
    ("2**10", None), ("__import__('os')", None), ("1/0", None), ("3.5+1", None), ("x+1", None), ("", None),
    ("1+" * 50 + "1", None)])
def test_calculate_is_arithmetic_on_integers_and_nothing_else(expression, value):
    from megatron_rl.environments.calculator import calculate

    assert calculate(expression) == value


def test_the_calculator_answers_calls_then_scores_the_first_answer():
    from megatron_rl.environments.calculator import INSTRUCTION, MAX_CALLS, Calculator

    rec = {"prompt": "Ava has 45 cookies. Ava buys 8 more cookies. How many?", "reference": "53"}
    env = Calculator(rec, 0)
    assert env.reset() == f"{rec['prompt']} {INSTRUCTION}"
    assert env.step("sure <calc>45+8</calc>") == ({"role": "user", "content": "calculator: 53"}, 0.0, False)
    assert env.step("<calc>45/2</calc>")[0]["content"] == "calculator: 22.5"
    assert env.step("<calc>import os</calc>")[0]["content"] == "calculator: error"
    assert env.step("The answer is 53.") == (None, 1.0, True)
    assert Calculator(rec, 0).step("52") == (None, 0.0, True)
    assert Calculator(rec, 0).step("no idea") == (None, 0.0, True)
    env = Calculator(rec, 0)
    for _ in range(MAX_CALLS):
        assert env.step("<calc>1+1</calc>")[2] is False
    assert env.step("<calc>1+1</calc>") == (None, 0.0, True)  # out of calls: ended unanswered


def test_calculator_demonstrations_call_the_problems_arithmetic_and_answer_its_result():
    """Every demonstration is a prefix of an episode the environment scores 1 (a call of the problem's own
    arithmetic, then its result) or an answer off by 1 to 9; about demo_accuracy of them call the calculator."""
    from megatron_rl.environments.play import TurnTemplate
    from megatron_rl.controller.tasks import CalculatorTask
    from megatron_rl.environments.calculator import CALL, INSTRUCTION, Calculator, calculate
    from megatron_rl.tokenizers import load_tokenizer

    tok = load_tokenizer("byte")
    task = CalculatorTask(eval_size=8, template=TurnTemplate(tok, chat=False), stop_id=tok.eos_id, demo_accuracy=0.5)
    assert not {r.prompt for r in task.eval_records()} & {r.prompt for r in task.train_batch(0, 500)}
    demos = task.demonstrations(0, 400)
    calls = 0
    for ids, answer in demos:
        text = tok.decode(ids)
        problem, after = text.split(f" {INSTRUCTION}")  # the instruction's own example call is not a call
        call = CALL.search(answer) or CALL.search(after)
        if call is None:  # answered at once, off by 1 to 9
            continue
        calls += 1
        rec = next(r for r in task.train if r.prompt == problem)
        assert calculate(call.group(1)) == int(rec.reference)
        if CALL.search(after):  # after the result: the answer is the result, which the environment scores 1
            env = Calculator(rec.as_dict(), 0)
            env.step(call.group(0))
            assert env.step(answer) == (None, 1.0, True)
    assert 0.4 < calls / len(demos) < 0.6


def test_one_thread_drives_the_workers_merging_the_step_calls_queued_behind_a_running_one():
    """`PoolCalls` (`environments/play.py`): calls never overlap in the pool (it is not thread-safe), run in order,
    the step calls queued while one runs go together as one batch, and a failure reaches each caller of its batch."""
    import threading

    from megatron_rl.environments.play import PoolCalls

    class Pool:
        def __init__(self):
            self.inside, self.batches, self.overlaps = threading.Lock(), [], 0

        def _call(self, method, calls):
            if not self.inside.acquire(blocking=False):
                self.overlaps += 1
                self.inside.acquire()
            try:
                self.batches.append((method, list(calls)))
                time.sleep(0.05)
                if "boom" in calls:
                    raise RuntimeError("boom")
                return [f"{method}:{c}" for c in calls]
            finally:
                self.inside.release()

        def first(self, calls):
            return self._call("first", calls)

        def step(self, calls):
            return self._call("step", calls)

    pool = Pool()
    driver = PoolCalls(lambda: pool)
    a = driver.submit("step", ["a1", "a2"])
    time.sleep(0.01)  # a runs; the next three queue behind it
    b, c, d = driver.submit("step", ["b"]), driver.submit("step", ["c"]), driver.submit("first", ["d"])
    e = driver.submit("step", ["e"])
    assert d.result() == ["first:d"] and e.result() == ["step:e"]
    assert a.result() == ["step:a1", "step:a2"] and b.result() == ["step:b"] and c.result() == ["step:c"]
    assert pool.batches == [("step", ["a1", "a2"]), ("step", ["b", "c"]), ("first", ["d"]), ("step", ["e"])]
    x = driver.submit("step", ["x"])
    time.sleep(0.01)
    y, z = driver.submit("step", ["boom"]), driver.submit("step", ["z"])
    assert x.result() == ["step:x"]
    for call in (y, z):  # one batch: its error is each one's
        with pytest.raises(RuntimeError, match="boom"):
            call.result()
    driver.close()
    assert pool.overlaps == 0
    with pytest.raises(RuntimeError, match="closed"):
        driver.submit("step", ["late"])
