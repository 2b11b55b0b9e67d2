"""Pipeline parallelism.

`schedules` says *what* each pipeline rank does, as plain data (lists of `Action`s);
`check` simulates those lists, proves them deadlock-free and measures bubble and in-flight
activations; `draw` turns a simulated timeline into a PNG. None of the three imports torch,
so the planner and the tests can use them anywhere. The executor that runs the actions with
torch point-to-point calls lives beside them and follows the contract in `schedules`.
"""
