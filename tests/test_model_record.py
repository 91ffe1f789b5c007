"""The service handshake's model record: owners that would train different models are named before step 1.

Fast and in one process: each "owner" is an Estimator graph built here (one training step each), its
record read in its session by `model_record.ModelRecord`; `service_handshake.verdict` compares the rows as
server0's `handshake_table` hands them out. Mutations: without the learning rate (or the vocabulary) in
the record, the learning-rate (vocabulary) check must fail.
"""
import numpy as np
import pytest
import tensorflow as tf

from tfe_estimator.distribute import model_record, service_handshake
from tfe_estimator.distribute.service_aggregation import channel_name
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
    return service_handshake.verdict("chief:0", OWNERS, chief, model_record.model_id(chief[2]), rows, final=final)


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
    error, waiting = service_handshake.verdict("chief:0", OWNERS, records["base"], 1,
                                               [(m, r, a) for m, r, a in zip(models, rows, ages)])
    assert error is None and waiting == ["worker:0: no handshake yet"]


def test_an_owner_is_polling_for_another_model_only_when_its_calls_stay_fresh():
    polling = service_handshake.Polling()
    fresh, other = (5, [0, 1], 0.1), (5, [0, 1], 0.1)
    assert polling.update(OWNERS, [(7, [0, 1], 0.0), fresh], 7, now=0.0) == set()
    assert polling.update(OWNERS, [(7, [0, 1], 0.0), other], 7, now=0.5) == set()
    assert polling.update(OWNERS, [(7, [0, 1], 0.0), other], 7, now=1.1) == {"worker:0"}
    # An owner that agreed on its (previous) model stops calling: its calls age, it is never "polling".
    polling = service_handshake.Polling()
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
from tfe_estimator.distribute import weight_check  # noqa: E402


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
