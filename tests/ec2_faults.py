"""What EC2 does and moto's server cannot: run out of capacity, answer a launch late, and
price spot hosts.

A proxy in front of moto's server for the capacity tests. Every request is forwarded; a
RunInstances whose pool (instance type, subnet) and market are listed as out of capacity in
the control file is answered the way EC2 answers it (HTTP 500, an EC2 error document with
the code InsufficientInstanceCapacity) without reaching moto; with `hold_secs` set, a
RunInstances that moto served is answered only after that long (the launch happened, its
answer is late: what a leader that dies mid-launch leaves behind). Each RunInstances is
logged as one JSON line: type, subnet, market, client token, what was answered.

usage: ec2_faults.py PORT UPSTREAM_URL CONTROL_JSON LOG_JSONL

A DescribeSpotPriceHistory is answered by moto (which prices every type at $0.00001) with
the prices of the types listed in `spot_prices` put in, as EC2 would quote them.

The control file is read on every request: {"no_capacity": ["spot/g5.xlarge/subnet-1", ...,
"spot/*"], "hold_secs": 0, "spot_prices": {"t3.micro": "0.0104"}}.
"""

import json
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PORT, UPSTREAM, CONTROL, LOG = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]


def control():
    try:
        with open(CONTROL) as f:
            return json.load(f)
    except FileNotFoundError:
        return {}


def log(entry):
    with open(LOG, "a") as f:
        f.write(json.dumps(entry) + "\n")


class Proxy(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def reply(self, status, headers, body):
        self.send_response(status)
        for k, v in headers:
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def forward(self, body):
        req = urllib.request.Request(UPSTREAM + self.path, data=body, method=self.command)
        for k, v in self.headers.items():
            if k.lower() not in ("host", "content-length", "connection"):
                req.add_header(k, v)
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, r.getheaders(), r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.headers.items(), e.read()

    def priced(self, answer, prices):
        status, headers, out = answer
        if status != 200 or not prices:
            return answer

        def price(m):
            item = m.group(0)
            t = re.search(r"<instanceType>([^<]*)</instanceType>", item)
            if t and t.group(1) in prices:
                item = re.sub(r"<spotPrice>[^<]*</spotPrice>",
                              f"<spotPrice>{prices[t.group(1)]}</spotPrice>", item)
            return item

        text = re.sub(r"<item>.*?</item>", price, out.decode("utf-8"), flags=re.S)
        return status, headers, text.encode("utf-8")

    def handle_any(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        form = urllib.parse.parse_qs(body.decode("utf-8", "replace")) if body else {}
        one = lambda k: (form.get(k) or [""])[0]
        if one("Action") == "DescribeSpotPriceHistory":
            return self.reply(*self.priced(self.forward(body), control().get("spot_prices", {})))
        if one("Action") != "RunInstances":
            return self.reply(*self.forward(body))
        market = "spot" if one("InstanceMarketOptions.MarketType") == "spot" else "on-demand"
        pool = f"{market}/{one('InstanceType')}/{one('SubnetId')}"
        entry = {"type": one("InstanceType"), "subnet": one("SubnetId"), "market": market,
                 "token": one("ClientToken"), "at": time.time()}
        c = control()
        if pool in c.get("no_capacity", []) or f"{market}/*" in c.get("no_capacity", []):
            entry["answer"] = "InsufficientInstanceCapacity"
            log(entry)
            doc = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error>"
                   "<Code>InsufficientInstanceCapacity</Code><Message>We currently do not have "
                   f"sufficient {one('InstanceType')} capacity in the Availability Zone you "
                   "requested.</Message></Error></Errors>"
                   f"<RequestID>{uuid.uuid4()}</RequestID></Response>")
            return self.reply(500, [("Content-Type", "text/xml;charset=UTF-8")], doc.encode())
        status, headers, out = self.forward(body)
        entry["answer"] = status
        log(entry)
        time.sleep(float(c.get("hold_secs", 0)))
        self.reply(status, headers, out)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = handle_any


ThreadingHTTPServer(("127.0.0.1", PORT), Proxy).serve_forever()
