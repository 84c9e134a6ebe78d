// The checks tests/test_browser.py runs inside each page of the built site, once it has loaded:
// an async function of {title} that returns {problems: [sentences], counts: {...}, ms}.
// Chromium's console errors and the requests it blocked are collected by the test itself.
(async (opts) => {
  const problems = [];
  const counts = {formulas: 0, images: 0, animations: 0, widgets: 0, videos: 0};
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
  const start = Date.now();
  const until = async (condition, ms) => {
    const end = Date.now() + ms;
    while (!condition()) {
      if (Date.now() > end) return false;
      await sleep(25);
    }
    return true;
  };
  const timeout = (promise, ms) => Promise.race([promise, sleep(ms).then(() => 'timeout')]);
  const short = (s, n = 80) => (s || '').replace(/\s+/g, ' ').trim().slice(0, n);

  // The tab names the course, and the favicon loads.
  if (!document.title.includes(opts.title)) {
    problems.push(`the page title "${document.title}" does not name the course ("${opts.title}")`);
  }
  const icon = document.querySelector('link[rel~="icon"]');
  if (!icon) {
    problems.push('the page has no favicon');
  } else {
    const img = new Image();
    const loaded = new Promise((resolve) => { img.onload = () => resolve(true); img.onerror = () => resolve(false); });
    img.src = icon.href;
    if ((await timeout(loaded, 5000)) !== true) problems.push(`the favicon did not load: ${icon.href}`);
  }

  // Images (lazy ones are asked for now), then fonts.
  const images = [...document.images];
  images.forEach((img) => { if (img.loading === 'lazy') img.loading = 'eager'; });
  await until(() => images.every((img) => img.complete), 10000);
  counts.images = images.length;
  for (const img of images) {
    if (img.closest('div.animation')) continue;  // checked with its animation below
    if (!img.complete || img.naturalWidth === 0) {
      problems.push(`image did not load: ${img.getAttribute('src') || '(no src)'}`);
    }
  }

  // Animations: matplotlib's JS animations (Animation.to_jshtml, or rcParams animation.html).
  const animations = [...document.querySelectorAll('div.animation')];
  counts.animations = animations.length;
  for (const [i, div] of animations.entries()) {
    const name = `animation ${i + 1} of ${animations.length}`;
    const img = div.querySelector('img[id^="_anim_img"]');
    const slider = div.querySelector('input.anim-slider');
    const anim = img && window['anim' + img.id.slice('_anim_img'.length)];
    if (!img || !slider || !anim) {
      problems.push(`${name} did not start: its script did not run`);
      continue;
    }
    await until(() => anim.frames.every((f) => f.complete), 10000);
    const broken = anim.frames.filter((f) => !f.complete || f.naturalWidth === 0).length;
    if (broken) problems.push(`${name}: ${broken} of ${anim.frames.length} frames did not load`);
    if (img.naturalWidth === 0) problems.push(`${name} shows no frame`);
    const last = anim.frames.length - 1;
    anim.set_frame(last);
    if (img.getAttribute('src') !== anim.frames[last].src || Number(slider.value) !== last) {
      problems.push(`${name} does not move to its last frame`);
    }
    anim.set_frame(0);
    const blank = [...div.querySelectorAll('.anim-buttons button')]
      .filter((b) => b.getBoundingClientRect().width > 0 &&
                     [...b.children].every((c) => c.getBoundingClientRect().width === 0));
    if (blank.length) {
      problems.push(`${name}: ${blank.length} control buttons show no icon (icon font missing?)`);
    }
  }
  const videos = [...document.querySelectorAll('video')];
  counts.videos = videos.length;
  await until(() => videos.every((v) => v.error || v.readyState >= 1), 10000);
  for (const v of videos) {
    if (v.error || v.readyState < 1) {
      problems.push(`video did not load: ${short(v.currentSrc, 60)} (${v.error ? v.error.message || v.error.code : 'no data'})`);
    }
  }

  // ipywidgets saved with the notebook: @jupyter-widgets/html-manager draws each view into a
  // div.widget-subarea just before its <script type="...widget-view+json">.
  const views = [...document.querySelectorAll('script[type="application/vnd.jupyter.widget-view+json"]')];
  counts.widgets = views.length;
  if (views.length) {
    const drawn = (v) => {
      const area = v.previousElementSibling;
      return area && area.classList.contains('widget-subarea') &&
             area.querySelector('.jupyter-widgets, .lm-Widget');
    };
    const manager = [...document.scripts].some((s) => /embed-amd\.js|html-manager/.test(s.src));
    if (!document.querySelector('script[type="application/vnd.jupyter.widget-state+json"]')) {
      problems.push(`${views.length} widgets but no saved widget state on the page`);
    } else if (!manager || !window.requirejs) {
      problems.push(`${views.length} widgets not drawn: the page lacks ${window.requirejs ? 'embed-amd.js' : 'require.js'}`);
    } else {
      await until(() => views.every(drawn), 15000);
      const missing = views.filter((v) => !drawn(v));
      if (missing.length) {
        const id = (JSON.parse(missing[0].textContent || '{}').model_id) || '?';
        problems.push(`${missing.length} of ${views.length} widgets not drawn (e.g. model ${id})`);
      }
      const failed = document.querySelectorAll('.widget-subarea .jp-ErrorWidget, .widget-subarea .jupyter-widgets-error-widget');
      if (failed.length) problems.push(`${failed.length} widgets drawn as errors: ${short(failed[0].textContent)}`);
    }
  }

  // Math: MathJax (the site's own copy) typesets every formula, without errors.
  const formulas = [...document.querySelectorAll('.math')];
  counts.formulas = formulas.length;
  if (formulas.length) {
    // MathJax is a deferred script: it has run by the load event, or it never will.
    await until(() => window.MathJax && window.MathJax.version && window.MathJax.startup, 1000);
    if (!(window.MathJax && window.MathJax.version && window.MathJax.startup)) {
      const src = [...document.scripts].map((s) => s.src).find((s) => /mathjax/i.test(s));
      problems.push(`MathJax did not load (${src ? 'script ' + src : 'no MathJax script on the page'}), ` +
                    `so ${formulas.length} formulas are left as TeX, e.g. ${short(formulas[0].textContent)}`);
    } else {
      if ((await timeout(window.MathJax.startup.promise, 20000)) === 'timeout') {
        problems.push('MathJax did not finish typesetting in 20 s');
      }
      const raw = formulas.filter((f) => !f.querySelector('mjx-container'));
      if (raw.length) {
        problems.push(`${raw.length} of ${formulas.length} formulas not typeset by MathJax, e.g. ${short(raw[0].textContent)}`);
      }
      for (const err of [...document.querySelectorAll('mjx-merror')].slice(0, 3)) {
        problems.push(`MathJax could not typeset a formula: ${err.getAttribute('data-mjx-error') || short(err.textContent)}`);
      }
    }
  }
  // Typesetting asked for later (widget labels) is chained onto MathJax.startup.promise.
  if (window.MathJax && window.MathJax.startup && window.MathJax.startup.promise) {
    for (let p = null; p !== window.MathJax.startup.promise && Date.now() - start < 30000;) {
      p = window.MathJax.startup.promise;
      await timeout(p, 10000);
    }
  }
  // TeX left in the text, outside code: delimiters MathJax would have replaced.
  const tex = /\\\(|\\\[|\$\$|\\begin\{|\$[^$\n]*\\[A-Za-z]+[^$\n]*\$/;
  const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT, {
    acceptNode: (node) => node.parentElement.closest(
      'script, style, pre, code, textarea, noscript, mjx-container, .highlight, .math')
      ? NodeFilter.FILTER_REJECT : NodeFilter.FILTER_ACCEPT,
  });
  const leftovers = [];
  while (walker.nextNode()) {
    const m = walker.currentNode.textContent.match(tex);
    if (m) leftovers.push(short(walker.currentNode.textContent.slice(Math.max(0, m.index - 20)), 60));
  }
  if (leftovers.length) {
    problems.push(`TeX left unrendered in the text (${leftovers.length}x), e.g. "${leftovers[0]}"`);
  }

  // Display equations fit their column (issue 34). MathJax 3 sets a display equation on one line
  // however long it is; the theme lets the box around it scroll sideways (the scroll bar hidden
  // until touched) or the formula spills past the column, and a reader sees it stop mid-word
  // (9.1's once ended at "(master weights, mome"). Measured once MathJax has typeset the page.
  const texOf = (el) => {
    try {
      const items = window.MathJax.startup.document.getMathItemsWithin(el);
      if (items.length && items[0].math) return items[0].math;
    } catch (e) { /* the text as shown, below */ }
    return el.textContent;
  };
  counts.display_equations = 0;
  for (const eq of document.querySelectorAll('mjx-container[display="true"]')) {
    const math = eq.querySelector('mjx-math');
    if (!math || eq.getBoundingClientRect().width === 0) continue;  // in a closed fold
    counts.display_equations += 1;
    const holder = eq.closest('div.math') || eq;
    const column = (eq.closest('article') || document.body).getBoundingClientRect();
    const box = holder.getBoundingClientRect();
    const drawn = math.getBoundingClientRect();
    const past = Math.max(
      holder.scrollWidth - holder.clientWidth,  // scrolls sideways, or is clipped
      eq.scrollWidth - eq.clientWidth,
      drawn.right - Math.min(box.right, column.right),  // spills past its box or the column
      Math.max(box.left, column.left) - drawn.left,
    );
    if (past > 1) {
      problems.push(`a display equation is cut off: ${Math.round(past)} px of it lie past its ` +
                    `column (${Math.round(drawn.width)} px wide in ${Math.round(box.width)}): ` +
                    `"${short(texOf(eq), 70)}"`);
    }
  }

  // Figures as they show (issue 34): every cell's image and each animation's frame, with the
  // width it is drawn at. tests/test_browser.py reads the PNG's smallest text and resolution
  // (recorded by dpcourse.harness.figure_text when the notebooks ran) and works out the size of
  // that text on the page. A figure in a closed fold is not drawn and not measured.
  const figures = [];
  for (const img of document.images) {
    if (!img.closest('.cell_output, div.animation')) continue;
    const width = img.getBoundingClientRect().width;
    if (width === 0 || !img.complete || img.naturalWidth === 0) continue;
    const src = img.currentSrc || img.src;
    figures.push({
      src: src.startsWith('data:') ? src.slice(0, 4000) : src,  // PNG's metadata comes first
      shown: width,
      what: img.id || short(img.getAttribute('alt'), 60) || short(src, 60),
    });
  }

  // Fonts the page asked for (MathJax's, the theme's icons, the widgets') have loaded.
  await timeout(document.fonts.ready, 10000);
  for (const font of document.fonts) {
    if (font.status === 'error') problems.push(`font did not load: ${font.family}`);
  }
  // No cell output runs off the page: no box in an output area is wider than it shows, so
  // nothing scrolls sideways or spills past its box (the test's window is 1300 pixels wide, a
  // laptop's). Boxes that clip on purpose (a widget's label, with an ellipsis) do not count.
  const wide = [];
  for (const out of document.querySelectorAll('.cell_output')) {
    const right = out.getBoundingClientRect().right;
    for (const el of [out, ...out.querySelectorAll('*')]) {
      const overflow = getComputedStyle(el).overflowX;
      if (el.clientWidth === 0 || el.scrollWidth <= el.clientWidth + 1) continue;
      // A scroll bar, or content spilling visibly past the output's right edge (a slider's
      // handle that pokes out of its track but stays inside the output is fine).
      const scrolls = ['auto', 'scroll'].includes(overflow);
      const spills = overflow === 'visible'
        && el.getBoundingClientRect().left + el.scrollWidth > right + 1;
      if (scrolls || spills) {
        const what = el.tagName.toLowerCase() + (typeof el.className === 'string' && el.className
          ? '.' + el.className.trim().split(/\s+/).join('.') : '');
        wide.push(`${el.scrollWidth - el.clientWidth} px too wide (${what}, overflow ${overflow}): `
                  + `"${short(el.textContent, 60)}"`);
        break;  // one per output
      }
    }
  }
  const page = document.scrollingElement;
  if (page.scrollWidth > page.clientWidth + 1) {
    problems.push(`the page scrolls sideways, ${page.scrollWidth - page.clientWidth} px too wide`);
  }
  counts.wide_outputs = wide.length;
  for (const w of wide) problems.push(`a cell output scrolls sideways, ${w}`);
  // Nor does a table of the text: the theme lets a wide one scroll, cut off at the right edge.
  for (const table of document.querySelectorAll('article table')) {
    if (table.closest('.cell_output')) continue;  // counted above
    const box = table.closest('.pst-scrollable-table-container') || table.parentElement;
    if (box.scrollWidth > box.clientWidth + 1) {
      problems.push(`a table scrolls sideways, ${box.scrollWidth - box.clientWidth} px too wide: `
                    + `"${short(table.textContent, 60)}"`);
    }
  }
  // Text alternatives (issue 33): every image says something, neither nothing nor its file name
  // nor a word like "image"; a figure a cell drew (an image in a cell's output: matplotlib's PNG,
  // an animation's frame, a widget's drawing) says what it shows, in a sentence. Checked now, when
  // the widgets have drawn their images. An image hidden from assistive technology is not read.
  const placeholder = new RegExp('^(images?|img|figures?|fig|plots?|graphs?|charts?|pictures?|' +
    'diagrams?|animation|png|output|untitled|alt|none|todo|matplotlib figure|<figure size[^>]*>)$', 'i');
  const fileName = /\.(png|jpe?g|gif|svg|webp)\b|^data:|_images\//i;
  counts.figures = 0;
  for (const img of document.images) {
    if (img.closest('[aria-hidden="true"]')) continue;
    const figure = !!img.closest('.cell_output, div.animation');
    counts.figures += figure;
    const src = img.getAttribute('src') || '';
    const which = `${figure ? 'a figure' : 'an image'} (${src.startsWith('data:')
      ? (img.id || 'drawn from data: ' + short(img.closest('.cell_output, div.animation')?.textContent, 30))
      : short(src, 70)})`;
    const alt = (img.getAttribute('alt') || '').replace(/\s+/g, ' ').trim();
    if (!alt) {
      problems.push(`${which} has no alt text`);
    } else if (placeholder.test(alt) || fileName.test(alt)) {
      problems.push(`${which} has a placeholder for alt text: "${short(alt, 60)}"`);
    } else if (figure && alt.split(' ').length < 8) {
      problems.push(`${which}: its alt text is too short to say what it shows: "${alt}"`);
    }
  }

  // The page's buttons (issue 33): a chapter written as a notebook offers the notebook for
  // download (tests/test_site.py checks the file is there: file:// pages cannot fetch); launch buttons (Colab, Binder, a JupyterHub: only where
  // _config.yml names the repository) open this book's notebook, never Jupyter Book's own.
  const launches = [...document.querySelectorAll('.dropdown-launch-buttons a[href]')];
  counts.launch_buttons = launches.length;
  for (const a of launches) {
    if (/executablebooks\/jupyter-book/.test(a.href) || !/\.ipynb/.test(a.href)) {
      problems.push(`a launch button opens something other than this notebook: ${a.href}`);
    }
  }
  const notebook = document.querySelector('.dropdown-download-buttons a[href$=".ipynb"]');
  counts.notebook_downloads = notebook ? 1 : 0;
  if (!notebook && document.querySelector('div.cell')) {
    problems.push('a page with code cells offers no notebook to download');
  }
  return {problems, counts, figures, ms: Date.now() - start};
})
