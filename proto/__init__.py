"""Wire contracts: the only coupling between driftline's services.

The ``*.proto`` files are the source of truth; the ``*_pb2.py`` modules beside them are generated
by ``make proto`` (grpcio-tools) and committed. ``tests/test_proto.py`` fails when they are stale.
"""

from proto.action_pb2 import Action
from proto.dead_letter_pb2 import DeadLetter
from proto.example_pb2 import Example
from proto.feature_log_pb2 import Candidate, FeatureLog, ModelVersion
from proto.features_pb2 import Features, SparseSlot
from proto.parameter_delta_pb2 import DenseParameters, ParameterDelta, SampleRates, SparseRows, Tensor

__all__ = [
    "Action",
    "Candidate",
    "DeadLetter",
    "DenseParameters",
    "Example",
    "FeatureLog",
    "Features",
    "ModelVersion",
    "ParameterDelta",
    "SampleRates",
    "SparseRows",
    "SparseSlot",
    "Tensor",
]
