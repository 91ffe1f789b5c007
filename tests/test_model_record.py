"""The service handshake's model record: owners that would train different models are named before step 1.

Fast and in one process: each "owner" is an Estimator graph built here (one training step each), its
record read in its session by `model_record.ModelRecord`; `handshake.verdict` compares the rows as
server0's `handshake_table` hands them out. Mutations: without the learning rate (or the vocabulary) in
the record, the learning-rate (vocabulary) check must fail.
"""
import numpy as np
import pytest
import tensorflow as tf

from tfe_estimator.owner import model_record, handshake
from tfe_estimator.owner.service_strategy import channel_name
from tfe_estimator.service.handshake_table import HandshakeTable

OWNERS = ["chief:0", "worker:0"]
SETTINGS = {"precision": "low", "update_ring_bits": 64, "clip_norm": None}


def _input_fn():
    features = {"x": tf.constant([[1.0], [2.0]]), "sex": tf.constant([["m"], ["f"]]),
                "age": tf.constant([[5.0], [15.0]])}
    return features, tf.constant([[1.0], [2.0]])


class _Record(tf.compat.v1.train.SessionRunHook):
    def __init__(self, settings):
        self.settings, self.value = settings, None

    def begin(self):
        self.record = model_record.ModelRecord(tf.compat.v1.get_default_graph(), self.settings, len(OWNERS))

    def after_create_session(self, session, coord):
        self.value = self.record.evaluate(session)


def _record(tmp_path_factory, learning_rate=0.01, vocabulary=("m", "f"), seed=1, kind="linear",
            boundaries=(10.0, 20.0), settings=SETTINGS):
    sex = tf.feature_column.categorical_column_with_vocabulary_list("sex", list(vocabulary))
    columns = [tf.feature_column.numeric_column("x"), tf.feature_column.indicator_column(sex),
               tf.feature_column.bucketized_column(tf.feature_column.numeric_column("age"), list(boundaries))]
    config = tf.estimator.RunConfig(tf_random_seed=seed, model_dir=str(tmp_path_factory.mktemp("m")))
    if kind == "linear":
        estimator = tf.estimator.LinearRegressor(columns, optimizer=tf.keras.optimizers.legacy.SGD(learning_rate),
                                                 config=config)
    elif kind == "v1":
        estimator = tf.compat.v1.estimator.LinearRegressor(
            columns, optimizer=lambda: tf.compat.v1.train.GradientDescentOptimizer(learning_rate), config=config)
    else:
        estimator = tf.estimator.DNNRegressor([3], columns, optimizer=tf.keras.optimizers.legacy.Adam(learning_rate),
                                              config=config)
    hook = _Record(settings)
    estimator.train(_input_fn, steps=1, hooks=[hook])
    return hook.value


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    make = lambda **kw: _record(tmp_path_factory, **kw)  # noqa: E731
    return {"base": make(), "lr": make(learning_rate=0.05), "vocab": make(vocabulary=("f", "m")),
            "buckets": make(boundaries=(10.0, 30.0)), "v1": make(kind="v1"),
            "v1_lr": make(kind="v1", learning_rate=0.05), "dnn": make(kind="dnn"), "dnn_seed": make(kind="dnn", seed=2),
            "dp": make(settings={**SETTINGS, "dp noise_multiplier": 1.1}),
            "dp2": make(settings={**SETTINGS, "dp noise_multiplier": 0.9})}


def _verdict(chief, worker, worker_age=0.1, final=False):
    """What the chief concludes when server0 holds both owners' rows (worker's under its own model id)."""
    table = HandshakeTable(OWNERS, clock=lambda: 100.0)
    for owner, (step, weights, fields) in ((1, worker), (0, chief)):
        table.put(owner, model_record.model_id(fields), model_record.make_row(step, weights, fields))
    rows, models, ages = table.view(model_record.model_id(chief[2]))
    rows = [(m, r, 0.0 if o == 0 else worker_age) for o, (m, r) in enumerate(zip(models, rows))]
    return handshake.verdict("chief:0", OWNERS, chief, model_record.model_id(chief[2]), rows, final=final)


def check_learning_rate_mismatch_is_refused_with_both_values(records):
    error, _ = _verdict(records["base"], records["lr"])
    assert error is not None and "refused before the first step" in error, error
    assert "learning rate of 'linear/linear_model/" in error and "0.05 on worker:0, 0.01 on chief:0" in error, error


def check_vocabulary_order_mismatch_is_refused_naming_the_feature(records):
    error, _ = _verdict(records["base"], records["vocab"])
    assert error is not None and "the vocabulary of feature 'sex'" in error and "differs" in error, error


def test_learning_rate_mismatch_is_refused_with_both_values(records):
    check_learning_rate_mismatch_is_refused_with_both_values(records)
    error, _ = _verdict(records["v1"], records["v1_lr"])  # a v1 optimizer: its learning rate is a constant
    assert "0.05 on worker:0, 0.01 on chief:0" in error, error


def test_vocabulary_order_mismatch_is_refused_naming_the_feature(records):
    check_vocabulary_order_mismatch_is_refused_naming_the_feature(records)


def test_bucket_boundaries_and_dp_settings_mismatches_are_named(records):
    error, _ = _verdict(records["base"], records["buckets"])
    assert "the bucket boundaries of feature 'age' differs" in error, error
    error, _ = _verdict(records["dp"], records["dp2"])
    assert "setting dp noise_multiplier: 0.9 on worker:0, 1.1 on chief:0" in error, error


def test_other_seed_is_refused_at_step_0_suggesting_tf_random_seed(records):
    for base, seed in (("dnn", "dnn_seed"),):  # a linear model starts from zeros whatever the seed
        assert model_record.model_id(records[base][2]) == model_record.model_id(records[seed][2])
        error, _ = _verdict(records[base], records[seed])
        assert "the initial weights differ at step 0" in error and "tf_random_seed" in error, error


def test_weights_are_compared_only_between_owners_at_the_same_step(records):
    step, weights, fields = records["dnn_seed"]
    error, waiting = _verdict(records["dnn"], (step + 4, weights, fields))  # a restored owner, behind
    assert error is None and waiting == []


def test_equal_records_agree_and_a_stale_row_of_another_model_only_waits(records):
    assert _verdict(records["base"], records["base"]) == (None, [])
    # The worker's latest row is another model but it is not handshaking now (e.g. it trains the previous
    # model of the script): wait, saying why; at the timeout, refuse naming what differs.
    error, waiting = _verdict(records["base"], records["lr"], worker_age=30.0)
    assert error is None and "worker:0: its last handshake (30 s ago, at step 0) was for another model" in waiting[0]
    error, _ = _verdict(records["base"], records["lr"], worker_age=30.0, final=True)
    assert "0.05 on worker:0, 0.01 on chief:0" in error, error
    table = HandshakeTable(OWNERS)
    rows, models, ages = table.view(1)
    error, waiting = handshake.verdict("chief:0", OWNERS, records["base"], 1,
                                               [(m, r, a) for m, r, a in zip(models, rows, ages)])
    assert error is None and waiting == ["worker:0: no handshake yet"]


def test_an_owner_is_polling_for_another_model_only_when_its_calls_stay_fresh():
    polling = handshake.Polling()
    fresh, other = (5, [0, 1], 0.1), (5, [0, 1], 0.1)
    assert polling.update(OWNERS, [(7, [0, 1], 0.0), fresh], 7, now=0.0) == set()
    assert polling.update(OWNERS, [(7, [0, 1], 0.0), other], 7, now=0.5) == set()
    assert polling.update(OWNERS, [(7, [0, 1], 0.0), other], 7, now=1.1) == {"worker:0"}
    # An owner that agreed on its (previous) model stops calling: its calls age, it is never "polling".
    polling = handshake.Polling()
    for now in (0.0, 0.6, 1.2, 1.8):
        assert polling.update(OWNERS, [(7, [0, 1], 0.0), (5, [0, 1], 0.2 + now)], 7, now=now) == set()


def test_models_of_different_sizes_or_settings_get_different_ids_and_channels(records):
    ids = {model_record.model_id(records[k][2]) for k in ("base", "lr", "vocab", "dnn", "v1", "dp")}
    assert len(ids) == 6
    assert len({channel_name(i, "sum_0") for i in ids}) == 6


def test_mutation_learning_rate_dropped_from_the_record_is_detected(records, monkeypatch):
    monkeypatch.setattr(model_record, "_NOT_HYPER", model_record._NOT_HYPER | {"alpha", "lr"})
    lr = _record_again(records, "lr")
    with pytest.raises(AssertionError):
        check_learning_rate_mismatch_is_refused_with_both_values({"base": _record_again(records, "base"), "lr": lr})


def test_mutation_vocabulary_dropped_from_the_record_is_detected(records, monkeypatch):
    monkeypatch.setattr(model_record.ModelRecord, "_constants", staticmethod(lambda graph: []))
    with pytest.raises(AssertionError):
        check_vocabulary_order_mismatch_is_refused_naming_the_feature(
            {"base": _record_again(records, "base"), "vocab": _record_again(records, "vocab")})


_AGAIN = {"base": {}, "lr": {"learning_rate": 0.05}, "vocab": {"vocabulary": ("f", "m")}}


def _record_again(records, name):
    """The record rebuilt under the current (mutated) code."""
    import tempfile  # pylint: disable=import-outside-toplevel

    class _Factory:
        @staticmethod
        def mktemp(_):
            return tempfile.mkdtemp()

    return _record(_Factory, **_AGAIN[name])


def test_the_weights_fingerprint_is_exact():
    a = [np.zeros(3, np.float32), np.ones(2, np.float32)]
    b = [np.zeros(3, np.float32), np.array([1.0, np.nextafter(np.float32(1), np.float32(2))], np.float32)]
    assert model_record.weights_fingerprint(a) == model_record.weights_fingerprint([x.copy() for x in a])
    assert model_record.weights_fingerprint(a) != model_record.weights_fingerprint(b)
    assert len(model_record.format_fingerprint(model_record.weights_fingerprint(a))) == 16


# ---------------------------------------------- weight checks through server0 --

from service_helpers import cert_dirs, make_service, owner_names  # noqa: E402,F401 (fixtures)
from tfe_estimator.owner import weight_check  # noqa: E402


def _weight_rows(make_service, worker_weights):
    """What the chief's weight check at step 12 concludes after both owners put their fingerprints on server0."""
    service = make_service(owner_names(2))
    chief, worker = service.clients_of(2)
    key = weight_check.check_key(7)
    mine = model_record.weights_fingerprint([np.arange(4, dtype=np.float32)])
    worker.handshake(12, [12, model_record.weights_fingerprint(worker_weights)], key)
    rows = chief.handshake(12, [12, mine], key)
    return weight_check.compare("chief:0", OWNERS, 12, mine, rows, key)


def check_an_altered_weight_stops_training_naming_the_owner_and_step(make_service):
    altered = np.arange(4, dtype=np.float32)
    altered[2] = np.nextafter(altered[2], np.float32(9))  # one bit of one weight
    error, _ = _weight_rows(make_service, [altered])
    assert error and "Weight check at step 12: the owners' weights differ" in error and "on worker:0" in error, error


def test_owners_with_equal_weights_agree_and_an_altered_one_is_named(make_service):
    assert _weight_rows(make_service, [np.arange(4, dtype=np.float32)]) == (None, [])
    check_an_altered_weight_stops_training_naming_the_owner_and_step(make_service)


def test_mutation_fingerprint_ignored_is_detected(make_service, monkeypatch):
    monkeypatch.setattr(model_record, "weights_fingerprint", lambda values: 0)
    with pytest.raises(AssertionError):
        check_an_altered_weight_stops_training_naming_the_owner_and_step(make_service)


def test_an_owner_behind_is_waited_for_and_one_ahead_is_not_compared():
    key = weight_check.check_key(7)
    assert key != 7 and weight_check.check_key(8) != key
    rows = [(key, [12, 1], 0.0), (key, [8, 2], 0.0)]
    assert weight_check.compare("chief:0", OWNERS, 12, 1, rows, key) == (None, ["worker:0"])
    rows = [(key, [12, 1], 0.0), (key, [16, 2], 0.0)]  # the chief replays released steps: worker:0 is ahead
    assert weight_check.compare("chief:0", OWNERS, 12, 1, rows, key) == (None, [])



def _checked_steps(monkeypatch, readings, hook_class=None):
    """The steps a `WeightCheckHook` (every 4 steps) compares at over 12 runs, when each run's fetched step is
    read before (`"before"`) or after (`"after"`) the run's own increment, as `readings(run)` says."""
    from tfe_estimator.owner import estimator  # pylint: disable=import-outside-toplevel

    checked = []
    monkeypatch.setattr(weight_check, "check_weights",
                        lambda binding, client, model, step, values, wait: checked.append(step))
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        tf.compat.v1.get_variable("w", [2])
        hook = (hook_class or estimator.WeightCheckHook)(None, None, {"model": 7}, 4)
        hook.begin()
        increment = step.assign_add(1)
        with tf.compat.v1.Session() as session:
            session.run(tf.compat.v1.global_variables_initializer())
            for run in range(12):
                before = int(session.run(step))
                session.run(increment)  # the run's training op
                stale = before if readings(run) == "before" else before + 1
                hook.after_run(tf.compat.v1.train.SessionRunContext((), session),
                               tf.compat.v1.train.SessionRunValues(stale, None, None))
    return checked


@pytest.mark.parametrize("readings", [lambda run: "before", lambda run: "after",
                                      lambda run: ("before", "after")[run % 2],
                                      lambda run: ("after", "before")[run % 2]],
                         ids=["before", "after", "alternating", "alternating-other"])
def test_every_owner_checks_its_weights_at_the_same_steps_whichever_way_its_step_read_raced(monkeypatch, readings):
    # Owners compare at checkpoint steps (every 4 here): each must pick the same steps, or the one that checks
    # waits out the other (a service-mode run lost a comparison and 108 s that way: step 39 on one owner, 40
    # on the other, when the fetched step was read after the run's increment on one and before it on the other).
    assert _checked_steps(monkeypatch, readings) == [4, 8, 12]


def test_mutation_a_check_step_decided_from_the_fetched_step_differs_between_owners(monkeypatch):
    """Mutation: the hint decides (no fresh read): the owner whose reads came after the increment checks at 3,
    7, 11, the other at 4, 8, 12 (or, hinted twice, at both)."""
    from tfe_estimator.owner import estimator  # pylint: disable=import-outside-toplevel

    class HintDecides(estimator.WeightCheckHook):
        def _check(self, session, wait_secs=None, only_every=False):
            super()._check(session, wait_secs, only_every=False)

    assert _checked_steps(monkeypatch, lambda run: "after", HintDecides) != [4, 8, 12]


# ------------------------------------------------------------ training runs --

from tfe_estimator.owner import training_run  # noqa: E402


def _checkpoint_in(model_dir):
    """A real checkpoint in `model_dir` (what a training that ran leaves there)."""
    with tf.Graph().as_default():
        step = tf.compat.v1.train.get_or_create_global_step()
        saver = tf.compat.v1.train.Saver([step])
        with tf.compat.v1.Session() as session:
            session.run(step.initializer)
            saver.save(session, str(model_dir / "model.ckpt"), global_step=0)


def test_each_fresh_training_of_a_process_gets_its_own_run_and_a_restarted_one_reads_its_own(tmp_path):
    training_run.reset()
    first, copy = tmp_path / "model", tmp_path / "model3"
    assert training_run.for_training(str(first)) == training_run.TrainingRun(0, fresh=True)
    _checkpoint_in(first)
    assert training_run.for_training(str(copy)) == training_run.TrainingRun(1, fresh=True)  # a fresh copy
    assert (copy / training_run.RUN_FILE).read_text() == "1\n"
    _checkpoint_in(copy)
    # The process restarts (alone, or every owner) during the copy: the first training resumes (or is skipped,
    # max_steps reached), the copy reads its own run back; a later fresh training is numbered after both.
    training_run.reset()
    assert training_run.for_training(str(copy)) == training_run.TrainingRun(1, fresh=False)
    assert training_run.for_evaluation(str(copy)) == 1 and training_run.for_evaluation(str(tmp_path / "x")) == 0
    assert training_run.for_training(str(tmp_path / "model4")).number == 2
    # A process that died after numbering a fresh training, before its first checkpoint: the same number again.
    training_run.reset()
    assert training_run.for_training(str(tmp_path / "model4")) == training_run.TrainingRun(2, fresh=True)
    training_run.reset()


def test_identical_records_of_two_training_runs_get_two_model_ids_and_a_mismatch_is_named(records):
    step, weights, fields = records["base"]
    runs = [make_run_record(fields, n) for n in (0, 1)]
    assert model_record.model_id(runs[0]) != model_record.model_id(runs[1])
    assert model_record.model_id(make_run_record(fields, 1)) == model_record.model_id(runs[1])
    error, _ = _verdict((step, weights, runs[0]), (step, weights, runs[1]))
    assert "setting training run: 1 on worker:0, 0 on chief:0" in error, error


def make_run_record(fields, number):
    """`fields` with the training run's setting (as `ServiceHandshakeHook` reads it from its settings)."""
    return list(fields) + [model_record._value_field("setting training run", number)]  # pylint: disable=protected-access


def _answered_twice(make_service, model):
    """Both owners put step 0 of a channel twice; `check_answer` on the chief's second (replayed) answer."""
    import os  # pylint: disable=import-outside-toplevel

    from service_helpers import in_threads  # pylint: disable=import-outside-toplevel
    from tfe_estimator.service import ring  # pylint: disable=import-outside-toplevel

    clients = make_service(owner_names(2)).clients_of(2)
    channel = channel_name(7, "sum_0")

    def put(client):
        key = np.frombuffer(os.urandom(16), np.int32)
        return client.contribute(channel, 0, 64, 4, key, (-ring.keystream_words(key, 4)).view(np.int64))

    for _ in range(2):  # an earlier training's step 0, then the same step again
        in_threads([lambda c=c: put(c) for c in clients])
    assert clients[0].answers[channel] == [1, 1]  # the servers flagged the second answer as a replay
    training_run.check_answer(model, "chief:0", channel, 0, replayed=True)


def test_a_fresh_training_answered_from_the_replay_window_is_refused_naming_the_fix(make_service):
    fresh = {"model": 7, "run": training_run.TrainingRun(0, fresh=True), "sessions": 1}
    with pytest.raises(ValueError, match=r"trains model 0000000000000007 afresh .* answered step 0 of "
                                         r"'0000000000000007/sum_0' from their replay window.*Restart the "
                                         r"aggregation servers"):
        _answered_twice(make_service, fresh)
    # A restored training (or a later session of a fresh one) catches up from the window: no refusal.
    _answered_twice(make_service, {**fresh, "run": training_run.TrainingRun(0, fresh=False)})
    _answered_twice(make_service, {**fresh, "sessions": 2})


def _released_again_after_both_servers_restart(make_service, model):
    """Steps 0-2 released to both owners, both servers restarted (no window), step 1 put again: `check_answer`
    on each of the chief's answers, as the owner's contribution op calls it."""
    import os  # pylint: disable=import-outside-toplevel

    from service_helpers import in_threads  # pylint: disable=import-outside-toplevel
    from tfe_estimator.service import ring  # pylint: disable=import-outside-toplevel

    channel = channel_name(7, "sum_0")

    def put(client, step):
        key = np.frombuffer(os.urandom(16), np.int32)
        before = client.answers.get(channel, [0, 0])[1]
        result = client.contribute(channel, step, 64, 4, key, (-ring.keystream_words(key, 4)).view(np.int64))
        return client.answers[channel][1] > before, result

    answers = []
    for steps in ((0, 1, 2), (1,)):  # the second service: both servers restarted, their windows lost
        clients = make_service(owner_names(2)).clients_of(2)
        for step in steps:
            (replayed, _), _ = in_threads([lambda c=c, s=step: put(c, s) for c in clients])
            answers.append((step, replayed))
            training_run.check_answer(model, "chief:0", channel, step, replayed)
    return answers


def test_under_dp_a_step_released_again_with_fresh_noise_is_refused_and_a_replay_is_not(tmp_path, make_service):
    ledger = training_run.ReleaseLedger(str(tmp_path), fresh=True)
    with pytest.raises(ValueError, match=r"chief:0 received step 1 of '0000000000000007/sum_0' as a fresh release, "
                                         r"but it received steps up to 2 before .*tfe_released.*Training stops"):
        _released_again_after_both_servers_restart(make_service, {"model": 7, "ledger": ledger})
    # The ledger survives the owner's restart (it is in model_dir): a restored owner's replays pass, a fresh
    # release of a step it had is refused, a later step is recorded.
    restored = training_run.ReleaseLedger(str(tmp_path), fresh=False)
    assert restored.high == 2
    model = {"model": 7, "ledger": restored}
    training_run.check_answer(model, "chief:0", channel_name(7, "sum_0"), 1, replayed=True)
    with pytest.raises(ValueError, match="received step 2"):
        training_run.check_answer(model, "chief:0", channel_name(7, "sum_0"), 2, replayed=False)
    training_run.check_answer(model, "chief:0", channel_name(7, "sum_0"), 3, replayed=False)
    assert training_run.ReleaseLedger(str(tmp_path), fresh=False).high == 3
    assert training_run.ReleaseLedger(str(tmp_path), fresh=True).high == -1  # a fresh training starts over


def test_when_the_user_allows_it_a_second_release_is_counted_for_epsilon(tmp_path, make_service):
    from tfe_estimator.owner import service_strategy  # pylint: disable=import-outside-toplevel

    ledger = training_run.ReleaseLedger(str(tmp_path), fresh=True, count_repeats=True)
    answers = _released_again_after_both_servers_restart(make_service, {"model": 7, "ledger": ledger})
    assert answers[-1] == (1, False) and ledger.repeated == 1 and ledger.high == 2
    # Kept in model_dir: a restarted owner and the evaluation of its checkpoints count it too.
    assert training_run.recorded_repeated_releases(str(tmp_path)) == 1
    assert training_run.ReleaseLedger(str(tmp_path), fresh=False).repeated == 1
    assert training_run.recorded_repeated_releases(str(tmp_path / "none")) == 0
    assert service_strategy.repeated_releases(tf.Graph()) == 0  # outside service mode


def test_mutation_without_the_ledger_a_second_release_passes_unnoticed(make_service):
    # Step 1 is released a second time (fresh, not from a window) and nothing refuses it.
    assert _released_again_after_both_servers_restart(make_service, {"model": 7})[-1] == (1, False)


def test_estimators_weight_check_hook_compares_at_every_checkpoint_step_and_at_the_end(monkeypatch):
    # The hook reads the global step (a strategy's MirroredVariable) as its read tensor, resolved once when it
    # begins: it still compares at steps 2 and 4 (checkpoint steps of every_n_steps=2) and at the end (step 5).
    from types import SimpleNamespace  # pylint: disable=import-outside-toplevel

    from tfe_estimator.owner.estimator import WeightCheckHook  # pylint: disable=import-outside-toplevel

    compared = []
    monkeypatch.setattr(weight_check, "check_weights",
                        lambda binding, client, model, step, values, wait_secs: compared.append((model, step)))
    with tf.Graph().as_default():
        with tf.distribute.MirroredStrategy(["/cpu:0"]).scope():
            step = tf.compat.v1.train.get_or_create_global_step()
        assert type(step).__name__ == "MirroredVariable"
        tf.compat.v1.get_variable("w", [2])  # a trainable variable the check reads
        hook = WeightCheckHook(SimpleNamespace(timeout_secs=10.0), None, {"model": 7}, every_n_steps=2)
        increment = tf.compat.v1.assign_add(step, 1)
        with tf.compat.v1.train.MonitoredSession(hooks=[hook]) as session:
            for _ in range(5):
                session.run(increment)
    assert compared == [(7, 2), (7, 4), (7, 5)]
