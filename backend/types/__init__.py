"""The data every engine folder shares, below the code that drives it: a request's state
while the engine works on it (`Sequence`), one step's plan and answer (`ScheduledSeq`,
`StepResult`), a batch row as the sampler sees it (`SamplingRow`) and a model's
architecture (`ModelConfig`). Imports only backend.contract (other folders' types under
TYPE_CHECKING alone)."""
