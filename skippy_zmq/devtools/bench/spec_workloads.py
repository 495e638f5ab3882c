"""bench spec's workloads: "copy", 8 requests whose answer repeats much of the prompt (each over a
150-300 token source written here), and "chat", 8 open questions with little to copy; each the user
message in the model's chat template."""

from __future__ import annotations

from typing import Any


_LIGHTHOUSE = (
    "The lighthouse at Skerry Point was built in 1874 by a team of forty masons who lived on the island "
    "for three summers. Its tower is made of granite blocks cut on the mainland and carried across by "
    "barge, each one numbered so that it could be fitted in the right place. The lamp was first fuelled "
    "with whale oil, then with paraffin, and finally, in 1952, it was converted to electricity. For most "
    "of its history the light was kept by two families who shared the work in shifts of six hours. They "
    "recorded the weather three times a day, repaired the clockwork that turned the lens, and rowed to "
    "the village once a week for supplies. The last keeper left in 1989, when the light became automatic. "
    "Today the keepers' cottages are a small museum, and visitors can climb the one hundred and twelve "
    "steps to the lantern room on calm days between May and September.")

_TYPOS = (
    "Our team has been working on the new booking sytem for the past three months. The main goal was to "
    "make it easier for customers to find an avialable slot and confirm it in less then a minute. In the "
    "first version, users had to fill in a long form with their adress, phone number and prefered time, "
    "and many of them gave up before the end. The new desing shows the calendar first, lets people pick a "
    "time with one click, and only asks for the details that are really neccessary. We tested it with "
    "twenty volunteers last week and the results were very encouraging: the average time to complete a "
    "booking droped from four minutes to about fifty seconds, and nobody abandonned the process. There "
    "are still a few issues to fix, especialy on small phone screens, but we expect to release it to "
    "everyone at the begining of next month.")

_PYTHON = '''def load_orders(path, min_total=0, currency="EUR"):
    orders = []
    with open(path) as handle:
        for line_number, line in enumerate(handle, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            fields = line.split(",")
            if len(fields) != 4:
                raise ValueError(f"line {line_number}: expected 4 fields, got {len(fields)}")
            order_id, customer, total, code = fields
            total = float(total)
            if code != currency or total < min_total:
                continue
            orders.append({"id": int(order_id), "customer": customer, "total": total})
    orders.sort(key=lambda order: order["total"], reverse=True)
    return orders


def summarize(orders):
    if not orders:
        return {"count": 0, "sum": 0.0, "largest": None}
    total = sum(order["total"] for order in orders)
    return {"count": len(orders), "sum": round(total, 2), "largest": orders[0]["id"]}'''

_TEAM = (
    "- Maria Lopez, engineering manager, Madrid, started 2015\n"
    "- Tom Becker, backend developer, Berlin, started 2018\n"
    "- Aisha Khan, data scientist, London, started 2020\n"
    "- Kenji Sato, frontend developer, Tokyo, started 2019\n"
    "- Olivia Brown, product designer, Toronto, started 2021\n"
    "- Lucas Martin, site reliability engineer, Lyon, started 2017\n"
    "- Sofia Rossi, quality engineer, Milan, started 2022\n"
    "- Daniel Novak, security engineer, Prague, started 2016\n"
    "- Emma Wilson, technical writer, Dublin, started 2023\n"
    "- Ravi Patel, machine learning engineer, Bangalore, started 2019")

_ARTICLE = (
    "City officials announced on Monday that the riverside park will reopen in April after a two-year "
    "renovation. \"We wanted a park that floods safely instead of a park that is closed every winter,\" "
    "said the project's lead architect, Hanna Berg. The new design lowers part of the lawn by a metre so "
    "that high water can spread out without reaching the houses behind it. Around four hundred trees have "
    "been planted, most of them species that tolerate wet soil, such as willows and alders. The "
    "renovation cost eleven million euros, two million more than planned, mainly because of the price of "
    "steel for the new footbridge. \"The delay was frustrating, but the bridge will last a hundred years,\" "
    "the deputy mayor told reporters. Local businesses have welcomed the news. The owner of a café near "
    "the main entrance said that her sales fell by a third while the park was closed and that she hopes "
    "the spring opening will bring her customers back.")

_CSV = (
    "city,country,population,area_km2,founded\n"
    "Lisbon,Portugal,545000,100,1200 BC\n"
    "Vienna,Austria,1980000,415,500 BC\n"
    "Krakow,Poland,800000,327,7th century\n"
    "Edinburgh,United Kingdom,525000,264,12th century\n"
    "Seville,Spain,685000,140,8th century BC\n"
    "Bergen,Norway,285000,465,1070\n"
    "Ghent,Belgium,265000,156,630\n"
    "Porto,Portugal,232000,41,300 BC\n"
    "Tallinn,Estonia,450000,159,1248\n"
    "Bologna,Italy,390000,141,534 BC")

_JS = '''function groupByStatus(data) {
  const result = {};
  for (const item of data) {
    if (!item || !item.status) {
      continue;
    }
    if (!result[item.status]) {
      result[item.status] = [];
    }
    result[item.status].push(item);
  }
  return result;
}

function countOverdue(data, today) {
  let count = 0;
  for (const item of data) {
    if (item.status !== "done" && new Date(item.due) < today) {
      count += 1;
    }
  }
  return count;
}

function summary(data) {
  const groups = groupByStatus(data);
  const overdue = countOverdue(data, new Date());
  return { total: data.length, groups: Object.keys(groups).length, overdue };
}'''

_EMAIL = (
    "Hi Mark,\n\n"
    "The invoice you sent on the 3rd is wrong again. It lists twelve hours of support for March, but we "
    "only used seven, and the hourly rate is the old one from last year. Fix it and send a new one by "
    "Friday. Also, the report you promised two weeks ago still hasn't arrived. We need it before the "
    "board meeting on the 18th, so don't make us wait any longer. And tell your team to stop calling our "
    "office after six; if something is urgent they can email the support address like everyone else. "
    "We have worked with you for five years and we want to keep doing so, but these mistakes keep "
    "happening and they cost us time every month.\n\n"
    "Regards,\nJulia Fischer\nOperations, Northwind Logistics")

COPY_TASKS: tuple[tuple[str, str], ...] = (
    ("Repeat the following text exactly, word for word, without adding anything.", _LIGHTHOUSE),
    ("Fix the typos in this paragraph and print the corrected paragraph in full.", _TYPOS),
    ("Rewrite this Python code adding type hints to every function. Keep the bodies unchanged.", _PYTHON),
    ("Convert this list to JSON: an array of objects with the keys name, role, city and start_year.", _TEAM),
    ("Summarise this article in three bullet points, quoting its key sentences word for word.", _ARTICLE),
    ("Convert this CSV to a Markdown table with the same columns and rows.", _CSV),
    ("Rename the parameter `data` to `tasks` everywhere in this JavaScript code and print the whole code.", _JS),
    ("Rewrite this email so that it is polite and friendly, keeping every fact, date and request.", _EMAIL),
)

CHAT_QUESTIONS: tuple[str, ...] = (
    "What are the main differences between a comet and an asteroid?",
    "Give me some ideas for a birthday party for a ten-year-old who loves dinosaurs.",
    "Why do leaves change colour in autumn?",
    "How can I get better at public speaking?",
    "Write a short story about a robot who learns to paint.",
    "What should I think about before adopting a dog?",
    "Explain how a bicycle stays upright when it moves.",
    "What are some healthy breakfast ideas for busy mornings?",
)


def copy_messages() -> list[str]:
    return [f"{instruction}\n\n{text}" for instruction, text in COPY_TASKS]


def workloads(tokenizer: Any, n: int | None = None) -> dict[str, list[list[int]]]:
    """Prompt ids per workload: the user message in the model's chat template."""
    def ids(text: str) -> list[int]:
        return tokenizer.encode_chat([{"role": "user", "content": text}])

    return {"copy": [ids(t) for t in copy_messages()[:n]], "chat": [ids(q) for q in CHAT_QUESTIONS[:n]]}
