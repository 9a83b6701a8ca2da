"""honest:tool is honest: the report's banner names only privileged snapshots, never a writer that used a tool."""

import pandas as pd

from tosca_mlmt.analysis.report import environment_lines


def test_a_tool_environment_is_not_called_privileged():
    assert "**honest**" in environment_lines(pd.DataFrame({"environment": ["honest", "honest:tool"]}))[0]
    banner = environment_lines(pd.DataFrame({"environment": ["honest:tool", "privileged:grading_tests"]}))[0]
    assert "`privileged:grading_tests`" in banner and "honest:tool" not in banner and "mixed" in banner
