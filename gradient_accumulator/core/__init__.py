"""What accumulation is, without Keras: the engine (state, the
accumulate-or-apply decision, the update's one all-reduce), the settings and
their checks, how a micro-batch is weighted and differentiated, and the
arithmetic on gradient sums. Plain TensorFlow; ``tests/core/test_core.py`` checks
that no module here imports a Keras or a module outside this folder. The
hosts (the model and optimizer wrappers, BatchNorm) translate Keras' objects
into these terms."""
