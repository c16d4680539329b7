"""Host logic written once for Keras 3 and tf-keras, told its Keras by a
small record (``Keras`` in each module): ``accumulate`` in place, replacing
BatchNorm layers, ``verify``'s two runs, the training-control callbacks, the
epoch-end policy for partial cycles and functional construction of the model
wrappers. Each Keras' public modules describe their Keras and keep the
public names and docs."""
