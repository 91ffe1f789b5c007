"""What makes two owners' updates differ, as a record the service-mode handshake compares.

Two data owners apply the same revealed update to their own copies of the
model; the copies stay equal only if everything that turns the update into
new weights, and the data into gradients, is equal too. `ModelRecord` reads
that from an owner's training graph (when it is complete, `begin` of a hook)
and its session (before the first step):

- the variables: names, shapes and dtypes (embedding dimensions, vocabulary
  and bucket counts show up as shapes);
- the optimizer of every variable (the apply op's type) and each of its
  hyperparameters (learning rate, momentum, betas, epsilon, l1, l2, ...),
  read from the apply op's inputs in the session, with the global step read
  as 0 (a learning-rate schedule is compared at its start, so owners at
  different steps still agree);
- the model's constants that give inputs their meaning: each lookup table's
  keys and values (vocabulary lists, in order), each vocabulary file's
  content, bucket boundaries, hash bucket counts;
- the secure and DP settings and the number of owners (`settings`).

Each field is ``(label, kind, value)``: an int (`INT`), a float64 carried as
its int64 bits (`FLOAT`, printed as a number) or a 63-bit hash (`HASH`, e.g. a
vocabulary). The model id (`model_id`) hashes every field, so it names one
model on every owner that would train it the same way; a handshake row adds
the step and the fingerprint of the weights' values (`weights_fingerprint`),
which owners compare only when they are at the same step.

`differences` names what differs between two owners' rows, with values where
they are numbers::

    learning rate of 'linear/linear_model/x/weights' (ResourceApplyGradientDescent alpha): 0.01 on worker:0,
    0.05 on chief:0
    vocabulary of feature 'sex' differs between worker:0 and chief:0

Example::

    record = ModelRecord(tf.compat.v1.get_default_graph(), {"precision": "low", "update_ring_bits": 64}, 2)
    ...
    step, weights, fields = record.evaluate(session)
    row = make_row(step, weights, fields)
"""
import hashlib
import logging
import os
import re
import struct
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf
from tensorflow.python.framework import tensor_util

__all__ = ["ModelRecord", "keras_record", "loop_record", "Field", "INT", "FLOAT", "HASH", "model_id", "make_row",
           "parse_row", "differences", "weights_fingerprint", "format_fingerprint", "label_hash", "HEADER"]

log = logging.getLogger("tfe_estimator")

#: Field kinds: an integer, a float64 (its bits as int64), a 63-bit hash.
INT, FLOAT, HASH = 0, 1, 2
#: A row: [step, weights fingerprint], then (label hash, kind, value) per field.
HEADER = 2
#: One field: its label (what the messages print), kind and value (an int64).
Field = Tuple[str, int, int]

#: Apply-op inputs that are not hyperparameters: the variable and its slots (handles), the gradient, the
#: indices of a sparse update, Adam's step-dependent powers.
_NOT_HYPER = {"var", "grad", "delta", "indices", "beta1_power", "beta2_power"}
#: Human names of hyperparameters (the apply ops' input names otherwise).
_HYPER_NAMES = {"alpha": "learning rate", "lr": "learning rate", "learning_rate": "learning rate"}
#: Ops a hyperparameter may be computed from (read in the session without running the input pipeline).
_STATEFUL_OK = {"VarHandleOp", "ReadVariableOp", "VariableV2", "VarIsInitializedOp"}
_MAX_WALK = 2000


def _hash63(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big") >> 1


def label_hash(label: str) -> int:
    """The 63-bit hash a row carries for a field's `label`."""
    return _hash63(label.encode())


def _float_bits(value: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _bits_float(bits: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(bits)))[0]


def _value_field(label: str, value) -> Field:
    """A field for a Python or NumPy value: ints and floats as numbers, anything else hashed."""
    if isinstance(value, (bool, np.bool_)) or value is None or isinstance(value, str):
        return label, HASH, _hash63(repr(value).encode())
    if isinstance(value, (int, np.integer)) and -2**63 <= int(value) < 2**63:
        return label, INT, int(value)
    if isinstance(value, (float, np.floating)):
        return label, FLOAT, _float_bits(value)
    array = np.asarray(value)
    if array.shape == () and array.dtype.kind in "iuf":
        return _value_field(label, array.item())
    return label, HASH, _hash63(repr(array.dtype).encode() + repr(array.shape).encode() + _bytes_of(array))


def _bytes_of(array: np.ndarray) -> bytes:
    if array.dtype == object:  # strings (a vocabulary): each with its length, so ["ab", "c"] != ["a", "bc"]
        return b"".join(len(b).to_bytes(8, "little") + b for b in
                        (v if isinstance(v, bytes) else str(v).encode() for v in array.reshape(-1)))
    return np.ascontiguousarray(array).tobytes()


def weights_fingerprint(values: Sequence[np.ndarray]) -> int:
    """A 63-bit hash of arrays' dtypes, shapes and bytes, in order (equal exactly when every value is equal)."""
    digest = hashlib.sha256()
    for value in values:
        array = np.asarray(value)
        digest.update(repr((array.dtype.str, array.shape)).encode())
        digest.update(_bytes_of(array))
    return int.from_bytes(digest.digest()[:8], "big") >> 1


def format_fingerprint(fingerprint: int) -> str:
    """A fingerprint as owners print and compare it: 16 hex digits."""
    return f"{int(fingerprint):016x}"


def model_id(fields: Sequence[Field]) -> int:
    """The model's id: a 63-bit hash of every field (label, kind, value), equal on owners with equal records."""
    return _hash63(repr([(label_hash(label), kind, int(value)) for label, kind, value in fields]).encode())


def make_row(step: int, weights: int, fields: Sequence[Field]) -> List[int]:
    """The handshake row: ``[step, weights fingerprint, label hash, kind, value, ...]``."""
    row = [int(step), int(weights)]
    for label, kind, value in fields:
        row += [label_hash(label), int(kind), int(value)]
    return row


def parse_row(row: Sequence[int]) -> Optional[Tuple[int, int, Dict[int, Tuple[int, int]]]]:
    """``(step, weights fingerprint, {label hash: (kind, value)})`` of a row; None if it is malformed."""
    row = [int(v) for v in row]
    if len(row) < HEADER or (len(row) - HEADER) % 3:
        return None
    fields = {}
    for i in range(HEADER, len(row), 3):
        fields[row[i]] = (row[i + 1], row[i + 2])
    return row[0], row[1], fields


def _show(kind: int, value: int) -> str:
    return f"{_bits_float(value):.6g}" if kind == FLOAT else str(value)


def differences(mine: Sequence[Field], me: str, theirs: Sequence[int], other: str, limit: int = 3) -> List[str]:
    """What differs between this owner's fields and another owner's row, in this owner's field order.

    Returns phrases such as ``"learning rate of 'x/weights' (...): 0.05 on worker:0, 0.01 on chief:0"``
    (numbers printed) or ``"vocabulary of feature 'sex' differs between worker:0 and chief:0"``; at most
    `limit` of them, then one saying how many more.
    """
    parsed = parse_row(theirs)
    if parsed is None:
        return [f"{other}'s handshake row is malformed ({len(theirs)} values): it runs another tfe_estimator "
                "version"]
    _, _, fields = parsed
    found, known = [], set()
    for label, kind, value in mine:
        key = label_hash(label)
        known.add(key)
        if key not in fields:
            found.append(f"{label} is part of {me}'s model, not of {other}'s")
        elif fields[key] != (kind, value):
            other_kind, other_value = fields[key]
            if kind == other_kind and kind in (INT, FLOAT):
                found.append(f"{label}: {_show(other_kind, other_value)} on {other}, {_show(kind, value)} on {me}")
            else:
                found.append(f"{label} differs between {other} and {me}")
    found = _merge_variables(found)
    extra = len([key for key in fields if key not in known])
    if extra:
        found.append(f"{other}'s model has {extra} field(s) {me}'s has not (other variables, optimizer "
                     "hyperparameters or feature constants)")
    if len(found) > limit:
        found = found[:limit] + [f"and {len(found) - limit} more"]
    return found


def _merge_variables(phrases: List[str]) -> List[str]:
    """One phrase per hyperparameter and values: "... of 'a' ...", "... of 'b' ..." become one, counting b."""
    merged: Dict[str, list] = {}
    for phrase in phrases:
        key = re.sub(r" of '[^']*' ", " of * ", phrase)
        merged.setdefault(key, [phrase, 0])[1] += 1
    return [phrase if count == 1 else
            re.sub(r"^(.*? of '[^']*')", rf"\1 (and {count - 1} more variables)", phrase, count=1)
            for phrase, count in merged.values()]


def _feature(op_name: str, pattern: str) -> str:
    match = re.search(pattern, op_name)
    return match.group(1) if match else op_name


def _constant(tensor) -> Optional[np.ndarray]:
    try:
        value = tensor_util.constant_value(tensor)
    except (TypeError, ValueError):  # pragma: no cover - constant_value gives up with None on most
        return None
    return None if value is None else np.asarray(value)


def _readable_in_session(tensor) -> bool:
    """Whether `tensor` is computed from constants and variables only (reading it runs no input pipeline)."""
    seen, todo = set(), [tensor.op]
    while todo:
        op = todo.pop()
        if op.name in seen:
            continue
        seen.add(op.name)
        if len(seen) > _MAX_WALK or op.type in ("Placeholder", "PlaceholderWithDefault") or (
                op.op_def.is_stateful and op.type not in _STATEFUL_OK):
            return False
        todo.extend(t.op for t in op.inputs)
        todo.extend(op.control_inputs)
    return True


def _variable_name(tensor) -> str:
    op = tensor.op
    while op.type in ("Identity", "ReadVariableOp") and op.inputs:
        op = op.inputs[0].op
    return op.name


def _path(variable) -> str:
    """A variable's full name: a Keras 3 variable's ``path`` ("sequential/dense/kernel": its ``name`` is only
    "kernel", and its dtype a string), else TensorFlow's ``name``."""
    return getattr(variable, "path", None) or variable.name


def _common_fields(settings: Mapping[str, object], num_owners: int, variables) -> List[Field]:
    """The fields of every record: the number of owners, the settings, the trainable variables' structure."""
    fields: List[Field] = [("the number of owners", INT, int(num_owners))]
    fields += [_value_field(f"setting {name}", value) for name, value in settings.items()]
    structure = ";".join(f"{_path(v)}:{v.shape}:{tf.as_dtype(v.dtype).name}" for v in variables)
    fields.append(("the structure of the trainable variables (names, shapes, dtypes; embedding "
                   "dimensions, vocabulary and bucket counts)", HASH, _hash63(structure.encode())))
    return fields


def _config_fields(what: str, obj) -> List[Field]:
    """A Keras object's class and each entry of its ``get_config()`` (numbers as numbers, the rest hashed)."""
    if obj is None or isinstance(obj, str):
        return [(f"the {what}", HASH, _hash63(repr(obj).encode()))]
    fields = [(f"the {what}", HASH, _hash63(type(obj).__name__.encode()))]
    config = obj.get_config() if hasattr(obj, "get_config") else {}
    for key, value in sorted(config.items()):
        if key == "name":
            continue
        label = f"{_HYPER_NAMES.get(key, key.replace('_', ' '))} of the {what} ({type(obj).__name__} {key})"
        scalar = isinstance(value, (int, float, bool, str, type(None), np.generic))
        fields.append(_value_field(label, value) if scalar else (label, HASH, _hash63(repr(value).encode())))
    return fields


def keras_record(model, settings: Mapping[str, object], num_owners: int) -> Tuple[int, int, List[Field]]:
    """A compiled Keras model's record, as `ModelRecord.evaluate` gives Estimator's: ``(step, weights, fields)``.

    Read eagerly (before ``fit``'s first step): the step is the optimizer's ``iterations``; the fields are the
    number of owners, `settings`, the trainable variables' structure, the optimizer's class and each of its
    hyperparameters (``get_config()``: learning rate, momentum, ...) and the compiled loss; the weights
    fingerprint covers every trainable variable's value.

    Example::

        step, weights, fields = keras_record(model, {"precision": "low"}, num_owners=2)
    """
    step, weights, fields = loop_record(model.optimizer, model.trainable_variables, settings, num_owners)
    loss = getattr(model, "loss", None)
    fields += _config_fields("loss", loss if isinstance(loss, str) or hasattr(loss, "get_config") else
                             getattr(loss, "__name__", repr(type(loss))))
    return step, weights, fields


def loop_record(optimizer, variables, settings: Mapping[str, object],
                num_owners: int) -> Tuple[int, int, List[Field]]:
    """A custom training loop's record: `keras_record`'s without the loss (the loop computes its own).

    Read eagerly (before the loop's first step): the step is `optimizer`'s ``iterations``; the fields are the
    number of owners, `settings`, the structure of `variables` (those the optimizer trains), the optimizer's
    class and each of its hyperparameters; the weights fingerprint covers every variable's value.

    Example::

        step, weights, fields = loop_record(optimizer, model.trainable_variables, {"precision": "low"}, 2)
    """
    variables = sorted(variables, key=_path)
    fields = _common_fields(settings, num_owners, variables) + _config_fields("optimizer", optimizer)
    step = int(optimizer.iterations.numpy())
    return step, weights_fingerprint([v.numpy() for v in variables]), fields


class ModelRecord:
    """An owner's model record (module docstring), built from a complete training graph.

    Args:
      graph: the training graph (complete: every apply op and lookup table in it).
      settings: the secure and DP settings, ``name -> value`` (ints and floats are printed in messages).
      num_owners: how many owners train together.

    Example::

        record = ModelRecord(graph, {"update_ring_bits": 64}, num_owners=2)
        step, weights, fields = record.evaluate(session)
    """

    def __init__(self, graph: tf.Graph, settings: Mapping[str, object], num_owners: int):
        with graph.as_default():
            variables = sorted(tf.compat.v1.trainable_variables(), key=lambda v: v.name)
            self._step = tf.compat.v1.train.get_global_step(graph)
        self._variables = variables
        self._static: List[Field] = _common_fields(settings, num_owners, variables)
        self._static += self._constants(graph)
        self._hyper_labels: List[str] = []
        self._hyper_tensors = []
        optimizers: List[Field] = []
        for op in graph.get_operations():
            if not re.match(r"^(Resource)?(Sparse)?Apply", op.type):
                continue
            names = [arg.name for arg in op.op_def.input_arg]
            variable = _variable_name(op.inputs[names.index("var")]) if "var" in names else op.name
            optimizers.append((f"the optimizer of '{variable}'", HASH, _hash63(op.type.encode())))
            for name, tensor in zip(names, op.inputs):
                if name in _NOT_HYPER or tensor.dtype == tf.resource or tensor.op.type in ("VariableV2",):
                    continue
                label = f"{_HYPER_NAMES.get(name, name)} of '{variable}' ({op.type} {name})"
                constant = _constant(tensor)
                if constant is not None:
                    optimizers.append(_value_field(label, constant))
                elif _readable_in_session(tensor):
                    self._hyper_labels.append(label)
                    self._hyper_tensors.append(tensor)
                else:  # computed from the step's data: only how it is computed can be compared
                    optimizers.append((label, HASH, _hash63(tensor.op.type.encode())))
        self._static += optimizers
        self._step_reads = self._global_step_reads(graph)

    def _global_step_reads(self, graph: tf.Graph):
        """The tensors that read the global step (fed 0 when hyperparameters are read: a schedule's start)."""
        if self._step is None:
            return []
        handles = set()
        for component in getattr(self._step, "values", (self._step,)):
            handle = getattr(component, "handle", None)
            handles.add(handle.op.name if handle is not None else component.op.name)
        reads = []
        for op in graph.get_operations():
            if op.type in ("ReadVariableOp", "Identity") and op.inputs and op.inputs[0].op.name in handles \
                    and graph.is_feedable(op.outputs[0]):
                reads.append(op.outputs[0])
        return reads

    @staticmethod
    def _constants(graph: tf.Graph) -> List[Field]:
        """The lookup tables' contents, vocabulary files, bucket boundaries and hash bucket counts."""
        fields: List[Field] = []
        seen: Dict[str, int] = {}

        def add(label, kind, value):
            seen[label] = seen.get(label, 0) + 1
            fields.append((label if seen[label] == 1 else f"{label} #{seen[label]}", kind, value))

        for op in graph.get_operations():
            if op.type in ("LookupTableImportV2", "InitializeTableV2", "LookupTableImport", "InitializeTable"):
                feature = _feature(op.name, r"([^/]+?)_lookup(?:_\d+)?/")
                parts = [_constant(t) for t in op.inputs[1:]]
                data = b"".join(b"?" if p is None else repr(p.shape).encode() + _bytes_of(p) for p in parts)
                add(f"the vocabulary of feature '{feature}' (its words in order)", HASH, _hash63(data))
            elif op.type in ("InitializeTableFromTextFileV2", "InitializeTableFromTextFile"):
                feature = _feature(op.name, r"([^/]+?)_lookup(?:_\d+)?/")
                name = _constant(op.inputs[1])
                content = repr(name).encode()
                if name is not None:
                    path = name.item().decode() if isinstance(name.item(), bytes) else str(name.item())
                    if os.path.isfile(path):
                        with open(path, "rb") as f:
                            content = f.read()
                attrs = repr([op.get_attr(a) for a in ("key_index", "value_index", "vocab_size", "delimiter")])
                add(f"the vocabulary file of feature '{feature}' (its content)", HASH,
                    _hash63(content + attrs.encode()))
            elif op.type == "Bucketize":
                feature = _feature(op.name, r"([^/]+?)_bucketized(?:_\d+)?/")
                add(f"the bucket boundaries of feature '{feature}'", HASH,
                    _hash63(repr([float(b) for b in op.get_attr("boundaries")]).encode()))
            elif op.type in ("StringToHashBucketFast", "StringToHashBucketStrong", "StringToHashBucket"):
                feature = _feature(op.name, r"([^/]+)/lookup$")
                add(f"the hash bucket count of feature '{feature}'", INT, int(op.get_attr("num_buckets")))
        return fields

    @property
    def variables(self):
        """The trainable variables, by name (what the weights fingerprint covers)."""
        return list(self._variables)

    def evaluate(self, session) -> Tuple[int, int, List[Field]]:
        """``(step, weights fingerprint, fields)``: read in `session` (one run; no input is consumed)."""
        step_tensor = tf.constant(0, tf.int64) if self._step is None else self._step
        step, weights = session.run([step_tensor, self._variables])
        fields = list(self._static)
        if self._hyper_tensors:
            feeds = {read: np.zeros(read.shape.as_list() or (), read.dtype.as_numpy_dtype)
                     for read in self._step_reads}
            try:
                hyper = session.run(self._hyper_tensors, feed_dict=feeds)
            except (tf.errors.OpError, ValueError, TypeError) as e:  # e.g. computed inside a loop: not fetchable
                log.warning("the service handshake compares how %d optimizer hyperparameters are computed, not "
                            "their values (%s)", len(self._hyper_tensors), str(e).splitlines()[0][:200])
                hyper = None
            for label, tensor, value in zip(self._hyper_labels, self._hyper_tensors,
                                            hyper or [None] * len(self._hyper_tensors)):
                fields.append(_value_field(label, value) if hyper is not None else
                              (label, HASH, _hash63(tensor.op.type.encode())))
        return int(step), weights_fingerprint(weights), fields
