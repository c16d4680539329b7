"""``core.loss_plan.loss_plan``, the one place that decides how a model
host weights, scales and unscales a micro-batch's loss, on exact small
numbers (eager, no Keras): the weight in the loss or on the gradients,
the backward share and unscaling under a loss scale, float8, several
denominators, the regularisation penalty of a summed loss, and the
replica conventions (each Keras', and a model's own loss)."""

import pytest
import tensorflow as tf

from gradient_accumulator.core.loss_plan import LossPlan, loss_plan
from gradient_accumulator.core.weighting import Denominator, own_denominator


def _mean(weight=4.0, count=None, terms=(0,)):
    count = weight if count is None else count
    return Denominator(list(terms), tf.constant(weight), tf.constant(count))


def _sum(opens=True, terms=(0,)):
    return Denominator(
        list(terms), tf.constant(1.0), tf.constant(1.0 if opens else 0.0), True
    )


def _cycle(length):
    return lambda: tf.constant(float(length))


def test_one_mean_group_puts_its_weight_in_the_loss():
    plan = loss_plan([_mean(4.0)])
    assert isinstance(plan, LossPlan)
    assert float(plan.loss_weight) == 4.0
    assert plan.unscale is None and plan.retry_scale is None
    assert plan.drops_penalty is None and plan.penalty_divisor == 1
    assert float(plan.groups[0].weight) == 4.0


def test_several_denominators_put_the_weights_on_the_gradients():
    groups = [_mean(4.0, terms=(0,)), _mean(2.0, terms=(1,))]
    plan = loss_plan(groups)
    assert plan.loss_weight == 1.0 and plan.unscale == 1.0
    scaled = loss_plan(groups, scale=tf.constant(8.0), cycle_length=_cycle(4))
    # Under a scale the loss is divided by its share of the cycle, 1/4,
    # and the gradients unscaled by both: 1 / (8 * 1/4).
    assert float(scaled.loss_weight) == 0.25
    assert float(scaled.unscale) == 0.5
    assert float(scaled.retry_scale) == 8.0


def test_a_loss_scale_divides_a_mean_by_its_share_of_the_cycle():
    plan = loss_plan([_mean(4.0)], scale=tf.constant(16.0), cycle_length=_cycle(2))
    assert float(plan.loss_weight) == 0.5
    assert float(plan.unscale) == 1.0 / 8.0
    assert float(plan.retry_scale) == 16.0
    # An in-step slice of a quarter of its step: 1/2 * 1/4.
    part = loss_plan(
        [_mean(4.0)],
        scale=tf.constant(16.0),
        cycle_length=_cycle(2),
        part=tf.constant(0.25),
    )
    assert float(part.loss_weight) == 0.125
    assert float(part.unscale) == 0.5


def test_a_summed_loss_needs_no_share():
    plan = loss_plan([_sum()], scale=tf.constant(4.0), cycle_length=_cycle(8))
    assert float(plan.loss_weight) == 1.0
    assert float(plan.unscale) == 0.25


def test_float8_takes_the_gradients_of_the_micro_batchs_own_loss():
    plan = loss_plan(
        [_mean(4.0)], scale=tf.constant(8.0), overwrites=True, cycle_length=_cycle(4)
    )
    assert plan.loss_weight == 1.0
    assert float(plan.unscale) == 0.125
    assert plan.retry_scale is None  # float8 layers are not differentiated twice
    assert loss_plan([_mean(4.0)], overwrites=True).unscale == 1.0
    # With several denominators the float8 variables are overwritten whole
    # by the first group: the scale path stays.
    two = [_mean(4.0, terms=(0,)), _mean(2.0, terms=(1,))]
    plan = loss_plan(
        two, scale=tf.constant(8.0), overwrites=True, cycle_length=_cycle(4)
    )
    assert float(plan.loss_weight) == 0.25 and float(plan.retry_scale) == 8.0


@pytest.mark.parametrize("opens", [True, False])
def test_a_summed_loss_keeps_its_penalty_once_per_cycle(opens):
    plan = loss_plan([_sum(opens)], penalty=True)
    assert bool(plan.drops_penalty) is not opens
    assert loss_plan([_sum(opens)]).drops_penalty is None
    assert loss_plan([_mean(4.0)], penalty=True).drops_penalty is None


def test_keras3_convention_leaves_the_groups_as_they_are():
    groups = [_mean(4.0, terms=(0,)), _sum(terms=(1,))]
    plan = loss_plan(groups, replicas=2, penalty=True)
    assert [float(g.weight) for g in plan.groups] == [4.0, 1.0]
    assert [float(g.count) for g in plan.groups] == [4.0, 1.0]
    assert plan.penalty_divisor == 1


def test_tf_keras_convention_weighs_means_and_counts_sums_per_replica():
    """tf-keras divides mean terms and the penalty by the replicas and
    leaves summed terms whole; the engine takes a weighted mean over
    replicas."""
    plan = loss_plan([_mean(4.0)], replicas=2, means_divided=True)
    assert float(plan.loss_weight) == 8.0
    assert float(plan.groups[0].count) == 4.0
    summed = loss_plan([_sum()], replicas=4, means_divided=True, penalty=True)
    assert float(summed.groups[0].weight) == 1.0
    assert float(summed.groups[0].count) == 0.25
    assert not bool(summed.drops_penalty)
    assert summed.penalty_divisor == 4
    # The penalty is decided from the count before the division.
    later = loss_plan([_sum(False)], replicas=4, means_divided=True, penalty=True)
    assert bool(later.drops_penalty) and float(later.groups[0].count) == 0.0


def test_own_loss_keeps_its_penalty_and_follows_the_replica_convention():
    """A model's own loss (``loss_denominator``): a penalty in it is the
    loss's own (never dropped), and its groups follow the same replica
    convention as compiled terms of the same reduction."""
    for divided in (False, True):
        for own in (False, True):
            summed = loss_plan(
                [_sum(False)], replicas=4, means_divided=divided, penalty=True, own=own
            )
            assert (summed.drops_penalty is None) == own
            mean = loss_plan([_mean(4.0)], replicas=2, means_divided=divided, own=own)
            # tf-keras divided the mean by the replicas: it weighs 2 x 4.
            assert float(mean.loss_weight) == (8.0 if divided else 4.0)
            assert float(mean.groups[0].count) == 4.0
    opening = loss_plan([_sum()], replicas=4, means_divided=True, own=True)
    assert float(opening.groups[0].count) == 0.25


def test_own_denominator_reads_the_declaration():
    """``weighting.own_denominator``: what a model's own loss groups as."""
    opens = lambda: tf.constant(True)  # noqa: E731
    batch = tf.constant(8.0)
    for declared in (None, "samples"):
        group = own_denominator(declared, batch, opens)
        assert (float(group.weight), float(group.count), group.sums) == (8, 8, False)
    summed = own_denominator("sum", batch, opens)
    assert (float(summed.weight), float(summed.count), summed.sums) == (1, 1, True)
    counted = own_denominator(tf.constant(5), batch, opens)  # a function's value
    assert (float(counted.weight), float(counted.count)) == (5.0, 5.0)
    with pytest.raises(ValueError, match="loss_denominator` must return a scalar"):
        own_denominator(tf.ones([2]), batch, opens)


def test_the_plan_is_a_frozen_record():
    plan = loss_plan([_mean(2.0)])
    with pytest.raises(AttributeError):
        plan.loss_weight = 1.0
