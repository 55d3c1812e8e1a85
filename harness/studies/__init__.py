"""Measurements beyond a row's own: trials turned into medians and scaling (benchmark), the machine's yardsticks
(calibration), where a step of several devices goes (split), the projection past one machine (projection), every
mode against an expert's step (expert), stock optimizers against the spec (conventions), a run checked step by step
against the spec (stepcheck), and the linear scaling rule (lr_scaling)."""
