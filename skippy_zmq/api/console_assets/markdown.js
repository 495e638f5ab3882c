// A small Markdown renderer that builds DOM nodes: model text only ever reaches the page as
// text nodes (textContent / createTextNode), never as HTML. Paragraphs, headings, code fences,
// bullet and numbered lists, inline code, bold and italic; anything else stays plain text.
"use strict";

(function () {
  const FENCE = /^\s*(```+|~~~+)\s*([\w#+.-]*)\s*$/;
  const HEADING = /^(#{1,6})\s+(.*)$/;
  const ITEM = /^(\s*)([-*+]|\d{1,9}[.)])\s+(.*)$/;
  // code spans, **bold**, __bold__, *italic*, _italic_ (not inside words, so snake_case stays)
  const INLINE = /(`+)([^`]|[^`][\s\S]*?[^`])\1(?!`)|\*\*(?=\S)([\s\S]*?\S)\*\*|__(?=\S)([\s\S]*?\S)__(?!\w)|\*(?=[^\s*])([^*]*?[^\s*]|[^\s*])\*|(?<!\w)_(?=[^\s_])([^_]*?[^\s_]|[^\s_])_(?!\w)/g;

  function el(tag, className) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    return node;
  }

  function inline(text, parent) {
    let last = 0;
    for (const m of text.matchAll(INLINE)) {
      if (m.index > last) appendText(parent, text.slice(last, m.index));
      if (m[1] !== undefined) {
        const code = el("code");
        code.textContent = m[2];
        parent.appendChild(code);
      } else {
        const strong = m[3] !== undefined || m[4] !== undefined;
        const node = el(strong ? "strong" : "em");
        inline(m[3] ?? m[4] ?? m[5] ?? m[6], node);
        parent.appendChild(node);
      }
      last = m.index + m[0].length;
    }
    if (last < text.length) appendText(parent, text.slice(last));
  }

  function appendText(parent, text) {   // single newlines inside a paragraph are line breaks
    text.split("\n").forEach((part, i) => {
      if (i > 0) parent.appendChild(el("br"));
      if (part) parent.appendChild(document.createTextNode(part));
    });
  }

  function codeBlock(lines, start, fence) {
    const open = lines[start].match(FENCE);
    const pre = el("pre");
    const code = el("code");
    if (open[2]) code.dataset.lang = open[2];
    const body = [];
    let i = start + 1;
    while (i < lines.length && !(lines[i].trim().startsWith(fence) && lines[i].trim().replace(/[`~]/g, "") === "")) {
      body.push(lines[i]);
      i += 1;
    }
    code.textContent = body.join("\n");   // an unclosed fence (still streaming) runs to the end
    pre.appendChild(code);
    return [pre, i + 1];
  }

  function list(lines, start) {
    const ordered = /\d/.test(lines[start].match(ITEM)[2]);
    const node = el(ordered ? "ol" : "ul");
    const first = parseInt(lines[start].match(ITEM)[2], 10);
    if (ordered && first !== 1) node.start = first;
    const items = [];
    let i = start;
    while (i < lines.length) {
      const m = lines[i].match(ITEM);
      if (m && /\d/.test(m[2]) === ordered) {
        items.push([m[3]]);
      } else if (/^\s+\S/.test(lines[i]) && !FENCE.test(lines[i])) {
        items[items.length - 1].push(lines[i].trim());   // an indented continuation line
      } else {
        break;
      }
      i += 1;
    }
    for (const text of items) {
      const li = el("li");
      inline(text.join("\n"), li);
      node.appendChild(li);
    }
    return [node, i];
  }

  function startsBlock(line) {
    return FENCE.test(line) || HEADING.test(line) || ITEM.test(line);
  }

  function render(text, target) {
    const frag = document.createDocumentFragment();
    const lines = text.replace(/\r\n?/g, "\n").split("\n");
    let i = 0;
    while (i < lines.length) {
      const line = lines[i];
      if (line.trim() === "") {
        i += 1;
        continue;
      }
      const fence = line.match(FENCE);
      const heading = line.match(HEADING);
      let node;
      if (fence) {
        [node, i] = codeBlock(lines, i, fence[1]);
      } else if (heading) {
        node = el(`h${Math.min(6, heading[1].length + 2)}`);
        inline(heading[2], node);
        i += 1;
      } else if (ITEM.test(line)) {
        [node, i] = list(lines, i);
      } else {
        const para = [line];
        i += 1;
        while (i < lines.length && lines[i].trim() !== "" && !startsBlock(lines[i])) {
          para.push(lines[i]);
          i += 1;
        }
        node = el("p");
        inline(para.join("\n"), node);
      }
      frag.appendChild(node);
    }
    target.replaceChildren(frag);
  }

  window.SkippyMarkdown = { render };
})();
