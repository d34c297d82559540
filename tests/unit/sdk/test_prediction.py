from agentkv._prediction import NextTurnPredictor


def test_no_prediction_before_a_sample():
    predictor = NextTurnPredictor()
    predictor.call_started(at=5.0)
    assert predictor.seconds is None


def test_measures_the_gap_after_a_tool_calls_response():
    predictor = NextTurnPredictor()
    predictor.response_ended("tool_calls", at=10.0)
    predictor.call_started(at=12.0)
    assert predictor.seconds == 2.0


def test_other_endings_are_not_tool_steps():
    predictor = NextTurnPredictor()
    predictor.response_ended("stop", at=10.0)
    predictor.call_started(at=30.0)
    assert predictor.seconds is None


def test_ewma_with_alpha_one_half():
    predictor = NextTurnPredictor(initial_seconds=4.0)
    predictor.add(2.0)
    assert predictor.seconds == 3.0
    predictor.response_ended("tool_calls", at=0.0)
    predictor.call_started(at=1.0)
    assert predictor.seconds == 2.0


def test_an_explicit_sample_replaces_the_measured_gap():
    predictor = NextTurnPredictor()
    predictor.response_ended("tool_calls", at=0.0)
    predictor.add(1.0)
    predictor.call_started(at=100.0)
    assert predictor.seconds == 1.0
