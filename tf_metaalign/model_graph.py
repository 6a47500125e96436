"""What a functional Keras model's graph says about multi-task training.

A functional (or Sequential) model is a graph of layer calls (nodes) from its inputs to
its outputs. Walking it back from each output gives the nodes that output depends on:

* a node reached from exactly ONE output is that output's task-specific computation (a
  head); a layer is task-specific for output t when every call of it in the graph is,
  and its variables are then output t's task-specific variables;
* everything reached from two or more outputs is shared (the trunk / encoder); so is a
  variable held by layers on both sides (weights tied across a head and the trunk);
* the shared REPRESENTATION is the tensor that the shared part hands to the heads: the
  output of a shared node consumed by a task-specific node (inputs of the model that a
  head reads directly do not count: no shared variable lies behind them).

Only the graph is read (public `model.outputs`, `model.layers` and, through
`tf_metaalign._compat.producing_node`, Keras's private node records); no variable is
created and nothing is called. A subclassed model has no graph: these functions raise a
ValueError for it, and the trainers then treat every variable as shared unless told
otherwise.
"""

from __future__ import annotations

import collections

import keras

from tf_metaalign import _compat


def has_graph(model: keras.Model) -> bool:
    """Whether `model` is a built functional or Sequential model (a graph to walk)."""
    try:
        outputs = model.outputs
    except (AttributeError, ValueError):
        return False
    return bool(outputs) and all(hasattr(t, "_keras_history") for t in outputs)


def _check_graph(model):
    if not has_graph(model):
        raise ValueError(
            f"The model {model.name!r} ({type(model).__name__}) has no functional graph "
            "(a subclassed model, or a Sequential model without an Input): its layers' "
            "connections cannot be read. Build it with the functional API (keras.Input "
            "... keras.Model(inputs, outputs)) or name the variables yourself."
        )


def _walk(tensors):
    """The nodes the KerasTensors `tensors` depend on: {id(node): (node, operation,
    input_tensors)}, in the order first reached."""
    seen = {}
    stack = list(tensors)
    while stack:
        tensor = stack.pop()
        produced = _compat.producing_node(tensor)
        if produced is None:
            continue
        node = produced[0]
        if id(node) in seen:
            continue
        seen[id(node)] = produced
        stack.extend(produced[2])
    return seen


def output_nodes(model: keras.Model):
    """Per flat output of `model` (the order of `model.outputs`), the nodes it depends on
    ({id(node): (node, operation, input_tensors)})."""
    _check_graph(model)
    return [_walk([t]) for t in model.outputs]


def _ownership(model):
    """(per-output node maps, {id(node): the outputs reaching it})."""
    per_output = output_nodes(model)
    reach = collections.defaultdict(set)
    for o, nodes in enumerate(per_output):
        for key in nodes:
            reach[key].add(o)
    return per_output, reach


def task_specific_layers(model: keras.Model):
    """Per flat output, the layers whose every call in the graph is reached from that
    output only (its head)."""
    per_output, reach = _ownership(model)
    owners = {}  # id(operation) -> set of owners (an output index, or "shared")
    operations = {}
    for nodes in per_output:
        for key, (_, operation, _) in nodes.items():
            owner = next(iter(reach[key])) if len(reach[key]) == 1 else "shared"
            owners.setdefault(id(operation), set()).add(owner)
            operations[id(operation)] = operation
    result = [[] for _ in per_output]
    for key, who in owners.items():
        if len(who) == 1 and next(iter(who)) != "shared":
            result[next(iter(who))].append(operations[key])
    return result


def task_specific_variables(model: keras.Model):
    """Per flat output, the trainable variables only that output depends on (the
    variables of its task-specific layers that no other layer of the graph holds)."""
    heads = task_specific_layers(model)
    holders = collections.defaultdict(set)  # id(variable) -> owners
    specific_ops = {id(op): o for o, ops in enumerate(heads) for op in ops}
    for nodes in output_nodes(model):
        for _, operation, _ in nodes.values():
            owner = specific_ops.get(id(operation), "shared")
            for v in getattr(operation, "trainable_variables", []):
                holders[id(v)].add(owner)
    result = [[] for _ in heads]
    for v in model.trainable_variables:
        who = holders.get(id(v), set())
        if len(who) == 1 and next(iter(who)) != "shared":
            result[next(iter(who))].append(v)
    return result


def upstream_variables(model: keras.Model, tensor):
    """The trainable variables of `model` that the KerasTensor `tensor` (a tensor of
    the model's graph) depends on, in the order of `model.trainable_variables`."""
    held = set()
    for _, operation, _ in _walk([tensor]).values():
        held |= {id(v) for v in getattr(operation, "trainable_variables", [])}
    return [v for v in model.trainable_variables if id(v) in held]


def layer_output(model: keras.Model, layer_name: str):
    """The one output tensor of the one call of the layer `layer_name` in `model`'s
    graph (a layer nested in a sub-model is not reachable: name the sub-model)."""
    _check_graph(model)
    found = [(node, op) for node, op, _ in _walk(model.outputs).values() if op.name == layer_name]
    if not found:
        names = sorted({op.name for _, op, _ in _walk(model.outputs).values()})
        raise ValueError(
            f"`representation`: no layer named {layer_name!r} in the graph of "
            f"the model {model.name!r}; its layers: {names}."
        )
    if len(found) > 1:
        raise ValueError(
            f"`representation`: the layer {layer_name!r} is called "
            f"{len(found)} times in the model's graph; name a layer called once."
        )
    outputs = list(found[0][0].output_tensors)
    if len(outputs) != 1:
        raise ValueError(
            f"`representation`: the layer {layer_name!r} has {len(outputs)} "
            "outputs; name a layer with one output tensor."
        )
    return outputs[0]


def layer_input(model: keras.Model, layer_type):
    """The first input tensor of the one call of a layer of class `layer_type` (e.g.
    `PerTaskHead`: the features it maps per task), or None if there is none."""
    _check_graph(model)
    found = [
        inputs for _, op, inputs in _walk(model.outputs).values() if isinstance(op, layer_type)
    ]
    if len(found) != 1:
        return None
    return found[0][0]


def shared_representation(model: keras.Model):
    """The one tensor the shared part of a multi-output model hands to the heads: the
    output of a shared node read by a task-specific node. ValueError if there is none
    or several (then the representation must be named)."""
    per_output, reach = _ownership(model)
    boundary = {}
    for nodes in per_output:
        for key, (_, _, inputs) in nodes.items():
            if len(reach[key]) != 1:
                continue
            for tensor in inputs:
                produced = _compat.producing_node(tensor)
                if produced is not None and len(reach[id(produced[0])]) > 1:
                    boundary[id(tensor)] = tensor
    if len(boundary) != 1:
        raise ValueError(
            f"The model {model.name!r} has {len(boundary)} tensors between its shared layers "
            "and its heads (" + ", ".join(t.name for t in boundary.values()) + "); give "
            "`representation=<layer name>`, the layer whose output is the shared "
            "representation."
        )
    return next(iter(boundary.values()))
