"""bench/advisor.py's finals: which cells run again before the grid's best is named."""
from bench import advisor as ab


def test_finalists_are_the_choice_ddp_and_the_cells_near_the_best():
    timed = {ab.DDP: [100.0, 104.0], "fp16": [50.0, 70.0], "int8": [54.0, 56.0], "topk": [56.0, 60.0],
             "dear": [80.0, 81.0], "out": [10.0, 10.0], ab.CHOICE: [90.0, 90.0]}
    pen = {k: (1.0, "benchmark") for k in timed}
    pen["topk"] = (1.05, "benchmark")  # 58 x 1.05 = 60.9: more than 1.1 x 55 = 60.5
    pen["out"] = (None, "no accuracy")  # a compressor without a penalty is never the grid's best
    # best grid score: int8 55 (fp16's median 60 is within 1.1 x 55; topk's 60.9 is not)
    assert ab.finalists_of(timed, pen) == [ab.DDP, "fp16", "int8", ab.CHOICE]


def test_the_choice_never_sets_the_bar():
    timed = {ab.DDP: [100.0], "fp16": [60.0], ab.CHOICE: [30.0]}
    pen = {k: (1.0, "benchmark") for k in timed}
    assert ab.finalists_of(timed, pen) == [ab.DDP, "fp16", ab.CHOICE]
