"""The panel's screens: main (the stage table and tabs) and its modal ones."""
def text_box_css(screen: str) -> str:
    """The framed, scrollable text box of the help and doctor screens."""
    return f"""
    {screen} #help {{
        width: 84; max-width: 100%; height: auto; max-height: 100%;
        border: round $accent; background: $surface; padding: 0 1;
    }}
    """
