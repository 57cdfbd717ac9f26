"""The schedule stage: which nodes form one kernel, and the candidates measured for each."""


class TemplateCandidate:
    """A candidate from one kernel template: ``sources`` to compile (one variant, key 0),
    ``kernels`` filled by the executor with the compiled ones, and a ``__call__`` (in the
    subclass) with the node's own signature that returns ``None`` where the run-time tensors do
    not fit what the kernel was generated for."""

    def __init__(self, name: str, source):
        self.name = name
        self.sources = {0: source}
        self.kernels: dict = {}

    @property
    def kernel(self):
        return self.kernels.get(0)
