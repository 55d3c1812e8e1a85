"""The command line's manners: one error line instead of a usage block, every default shown in --help, and the
list-valued options (--devices 1,2, --frameworks pytorch,jax)."""
import argparse


class Parser(argparse.ArgumentParser):
    def error(self, message):
        """One line, not the whole usage block: the problem and where to look."""
        self.exit(2, f"error: {message} (see python {self.prog} --help)\n")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows every default, except those that say nothing (no value, a flag that is off) and those its help
    already says in words ("default: ..."), which the value would contradict (an empty list, 0: computed later)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False or "(default" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def int_list(text):
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}")
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"every count must be an integer >= 1, got {text!r}")
    return values


def float_list(text):
    try:
        values = tuple(float(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    if not values:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}")
    return values


def name_list(choices, what):
    def parse(text):
        names = [n.strip() for n in text.split(",") if n.strip()]
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(map(repr, bad)) or repr(text)}; "
                                             f"choose from {', '.join(choices)}")
        return names
    return parse


def host_list(text):
    hosts = [h.strip() for h in text.split(",") if h.strip()]
    if len(hosts) < 2 or len(set(hosts)) != len(hosts):
        raise argparse.ArgumentTypeError(f"expected two or more different hosts, comma-separated, got {text!r}")
    return hosts
