from django.apps import AppConfig


class TestappConfig(AppConfig):
    """The label its migrations and tables were made under (it lived in tests/testapp): testapp."""

    name = "devkit.testapp"
    label = "testapp"
