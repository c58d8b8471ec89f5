// The menu on a phone (issue 42). The book's CSS hides the theme's top bar,
// whose "Toggle primary sidebar" button is the one the theme's scripts bind to
// (the first .primary-toggle of the page); the article's own button, the one a
// reader sees, is bound to nothing. Its clicks are passed on to the bound one:
// the chapter list opens as a dialog on a phone and folds away on a laptop.
document.addEventListener("DOMContentLoaded", () => {
  for (const kind of [".primary-toggle", ".secondary-toggle"]) {
    const [bound, ...others] = document.querySelectorAll(kind);
    others.forEach((button) =>
      button.addEventListener("click", (event) => {
        event.preventDefault();
        event.stopPropagation();
        bound.click();
      }),
    );
  }
});
